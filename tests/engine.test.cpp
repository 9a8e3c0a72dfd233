#include "zp/engine.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <chrono>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>

#include "zp/backend/threads.hpp"
#include "zp/dispatch.hpp"
#include "expect_error.hpp"
#include "huge_model.hpp"
#include "memory_check.hpp"
#include "temp_dir.hpp"
#include "zero_mlp.hpp"

using zp::Collective;
using zp::CollOp;
using zp::EngineConfig;
using zp::backend::run_threads;
using zp::backend::Threads;
using zp::backend::World;
using zp::test::Mlp;

namespace {

// Small buckets, so modules span several buckets and buckets of different sizes meet.
EngineConfig test_config(int micro_batch, int gas) {
  EngineConfig c;
  c.batch = {.micro_batch_per_rank = micro_batch, .gradient_accumulation_steps = gas};
  c.bucket_bytes = 4096;
  c.first_bucket_bytes = 512;
  c.align = 4;
  return c;
}

// Forward through every module inside the engine's guards on samples [first, first + 2), and
// the loss seeding backward.
template <class E, class T>
void forward_all(E& e, Mlp<T>& m, std::int64_t first) {
  std::vector<int> labels;
  m.load(first, 2, labels);
  for (int l = 0; l < m.modules(); ++l) {
    auto g = e.forward(l);
    m.forward(l);
  }
  m.loss(labels, e.loss_scale());
}

template <class T>
struct Trained {
  std::vector<T> params;
  std::vector<float> master;
  std::vector<float> losses;  // rank 0's micro-step losses
  std::vector<float> m, v;    // AdamW's state
  bool ranks_agree = true;    // every rank gathered rank 0's parameters and master weights
};

// `data_ranks` (0: all of them): rank r trains on rank r % data_ranks's samples of a run of
// data_ranks ranks, so rank r and r + data_ranks see the same data.
template <class T, int Stage>
Trained<T> train(int ranks, int steps, int gas, int micro_batch, EngineConfig cfg,
                 int data_ranks = 0) {
  Trained<T> out;
  std::vector<std::vector<T>> params(static_cast<std::size_t>(ranks));
  std::vector<std::vector<float>> masters(static_cast<std::size_t>(ranks));
  run_threads(ranks, [&](Collective<Threads>& comm) {
    const int n = data_ranks ? data_ranks : comm.size(), r = comm.rank() % n;
    Mlp<T> model;
    // eps 1e-4, not 1e-8: Adam divides by sqrt(v) + eps, so a gradient that is zero up to rounding
    // (a dead unit) would turn different roundings into full +-lr steps, and runs that should
    // agree to rounding would differ by 2 lr in a few elements for some seeds.
    zp::Engine<Threads, T, Stage> engine(comm, model, cfg,
                                         zp::optim::AdamW{.lr = 1e-2f, .eps = 1e-4f});
    std::vector<float> losses;
    for (int t = 0; t < steps; ++t)
      for (int i = 0; i < gas; ++i) {
        float loss = 0;
        const auto res = zp::test::micro_step(
            engine, model, (std::int64_t(t * gas + i) * n + r) * micro_batch, micro_batch, &loss);
        CHECK(res.boundary == (i + 1 == gas));
        CHECK(!res.overflow);
        losses.push_back(loss);
      }
    CHECK(engine.steps() == steps);
    auto p = engine.gather_params();
    auto m = engine.gather_master();
    auto m1 = engine.gather_state(0), v = engine.gather_state(1);
    params[std::size_t(comm.rank())] = p;
    masters[std::size_t(comm.rank())] = m;
    if (comm.rank() == 0)
      out = {std::move(p), std::move(m), std::move(losses), std::move(m1), std::move(v)};
  });
  for (std::size_t r = 1; r < params.size(); ++r)
    out.ranks_agree =
        out.ranks_agree &&
        std::memcmp(params[r].data(), params[0].data(), params[0].size() * sizeof(T)) == 0 &&
        std::memcmp(masters[r].data(), masters[0].data(), masters[0].size() * 4) == 0;
  return out;
}

// Mean loss over 512 samples no step trained on, of the model with parameters p (forward
// order, as gather_params returns them), or of its initial parameters when p is empty.
template <class T>
double held_out_loss(std::vector<T> p) {
  Mlp<T> m;
  std::size_t off = 0;
  if (!p.empty())
    for (auto& L : m.layers) {
      L.w.value.rebind(p.data() + off);
      off += L.w.size();
      L.b.value.rebind(p.data() + off);
      off += L.b.size();
    }
  REQUIRE(off == p.size());
  std::vector<int> labels;
  m.load(std::int64_t(1) << 30, 512, labels);
  for (int l = 0; l < m.modules(); ++l) m.forward(l);
  return m.loss(labels, 1.0f);
}

// train() at a stage known at run time.
template <class T>
Trained<T> train_at(int stage, int ranks, int steps, int gas, int mb, const EngineConfig& cfg,
                    int data_ranks = 0) {
  switch (stage) {
    case 0: return train<T, 0>(ranks, steps, gas, mb, cfg, data_ranks);
    case 1: return train<T, 1>(ranks, steps, gas, mb, cfg, data_ranks);
    case 2: return train<T, 2>(ranks, steps, gas, mb, cfg, data_ranks);
    default: return train<T, 3>(ranks, steps, gas, mb, cfg, data_ranks);
  }
}

template <class T>
Trained<T> train_stage(int stage, int ranks, int steps, int gas, int mb,
                       std::optional<zp::DType> accum = std::nullopt) {
  auto cfg = test_config(mb, gas);
  cfg.grad_accum_dtype = accum;
  return train_at<T>(stage, ranks, steps, gas, mb, cfg);
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Two runs that must train alike: parameters, master weights, AdamW's state and losses bitwise
// equal, every rank of `run` holding rank 0's.
template <class T>
void check_same_training(const Trained<T>& run, const Trained<T>& want) {
  CHECK(run.ranks_agree);
  CHECK(bitwise_equal(run.params, want.params));
  CHECK(bitwise_equal(run.master, want.master));
  CHECK(bitwise_equal(run.m, want.m));
  CHECK(bitwise_equal(run.v, want.v));
  CHECK(bitwise_equal(run.losses, want.losses));
}

struct Diff {
  double max = 0, mean = 0;
};
Diff diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  Diff d;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = std::fabs(double(a[i]) - double(b[i]));
    if (!(x <= d.max)) d.max = x;  // a NaN is the worst
    d.mean += x / double(a.size());
  }
  return d;
}

// How close two runs that differ only in rounding must stay: fp32 master weights after
// close_steps AdamW steps at lr 1e-2, on fresh data and weights every run. Few steps, because
// over many a rounding difference can push a unit across a ReLU kink and the runs then part
// for real (a CI run drew such a seed: max 0.02 in fp32 after 20 steps). Adam divides
// by sqrt(v), so an element whose gradient is near zero can take an update of up to about lr in
// one run and a smaller or opposite one in the other: no element drifts apart by more than
// 2 * close_steps * lr = 0.06. Measured over 15 seeds at 3 steps:
//   fp32: max 1.6e-7, mean 1e-9  -> bounds max 1e-5, mean 1e-7
//   bf16: max 0.02, mean 2.5e-4  -> bounds max 0.06 (the drift bound), mean 2e-3
// (bf16 rounds the gradients themselves to 8 bits, so more elements sit near the sign flip.)
constexpr int close_steps = 3;
template <class T>
void check_close(const Diff& d) {
  if constexpr (std::is_same_v<T, float>) {
    CHECK(d.max <= 1e-5);
    CHECK(d.mean <= 1e-7);
  } else {
    CHECK(d.max <= 2 * close_steps * 1e-2);
    CHECK(d.mean <= 2e-3);
  }
}

}  // namespace

TEST_CASE_TEMPLATE(
    "stages 0-3 give bitwise identical parameters after 10 steps (20 at 4 ranks, where it must "
    "learn) without accumulation",
    T, float, zp::bf16) {
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    const int steps = ranks == 4 ? 20 : 10;
    const auto s0 = train_stage<T>(0, ranks, steps, 1, 3);
    REQUIRE(s0.losses.size() == std::size_t(steps));
    if (ranks == 4) {  // it learns: with 12 samples a step, the loss on unseen samples falls
      const double before = held_out_loss<T>({}), after = held_out_loss(s0.params);
      INFO("held-out loss ", before, " -> ", after);
      CHECK(after < before);
    }
    for (int stage : {1, 2, 3}) {
      CAPTURE(stage);
      const auto s = train_stage<T>(stage, ranks, steps, 1, 3);
      CHECK(bitwise_equal(s.params, s0.params));
      CHECK(bitwise_equal(s.master, s0.master));
      CHECK(bitwise_equal(s.losses, s0.losses));
    }
  }
}

// Stage 0 and 1 accumulate locally in T and reduce once; stage 2 and 3 reduce every micro-step
// and accumulate the reduced shards: within each pair the order of every addition is the same,
// across pairs it differs, so they agree only to the rounding of T (check_close). (bf16 stage 0
// accumulates in fp32 by default, as DeepSpeed; here both accumulate in T.)
TEST_CASE_TEMPLATE("with accumulation, stages that sum in the same order stay bitwise identical", T,
                   float, zp::bf16) {
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    const auto s0 = train_stage<T>(0, ranks, 10, 4, 2, zp::dtype_of<T>);
    const auto s1 = train_stage<T>(1, ranks, 10, 4, 2);
    const auto s2 = train_stage<T>(2, ranks, 10, 4, 2);
    const auto s3 = train_stage<T>(3, ranks, 10, 4, 2);
    CHECK(bitwise_equal(s0.master, s1.master));
    CHECK(bitwise_equal(s2.master, s3.master));
    CHECK(bitwise_equal(s2.params, s3.params));
    const Diff d = diff(train_stage<T>(0, ranks, close_steps, 4, 2, zp::dtype_of<T>).master,
                        train_stage<T>(2, ranks, close_steps, 4, 2).master);
    MESSAGE("stage 0 vs 2 with accumulation, ", ranks, " ranks: |diff| max ", d.max, " mean ",
            d.mean);
    check_close<T>(d);
  }
}

// ZeRO-Offload: the master weights and optimizer state on the host, updated by the CPU step
// from host copies of the gradient shard; on the threads backend the copies are memcpys, so this
// checks the offload path's staging, pieces and conversions. ZeRO-Infinity: the same state in a
// swap file per rank, stepped sub-group by sub-group through the swap's buffers (sub-groups of
// 2048 elements, so segments straddle them), with and without read-ahead and write-behind. Both
// bitwise equal to no offload in every field; the memory report puts the bytes on the host or
// on NVMe; no swap file outlives its engine.
TEST_CASE_TEMPLATE("offloaded optimizer state, in host memory or on NVMe, trains bitwise the same",
                   T, float, zp::bf16) {
  zp::test::TempDir dir("nvme");
  for (int stage = 0; stage <= 3; ++stage)
    for (int ranks : {1, 3}) {
      CAPTURE(stage);
      CAPTURE(ranks);
      // Clipping on, so the norm computed before the offloaded update feeds it.
      EngineConfig cfg = test_config(2, 2);
      cfg.max_grad_norm = 0.5f;
      const Trained<T> plain = train_at<T>(stage, ranks, 6, 2, 2, cfg);
      cfg.offload_optimizer = true;
      std::vector<Trained<T>> offloaded{train_at<T>(stage, ranks, 6, 2, 2, cfg)};
#if defined(ZP_WITH_AIO)
      cfg.optimizer_nvme = zp::NvmeOptions{.path = dir.path,
                                           .buffer_count = 2 + stage,
                                           .pipeline_read = stage % 2 == 1,
                                           .pipeline_write = stage >= 2,
                                           .sub_group_size = 1000,
                                           .queue_depth = 2,
                                           .block_size = 4096};
      offloaded.push_back(train_at<T>(stage, ranks, 6, 2, 2, cfg));
      if (stage == 3) {  // the parameter shard on NVMe too, then alone
        cfg.param_nvme = zp::NvmeOptions{.path = dir.path, .block_size = 8192};
        offloaded.push_back(train_at<T>(stage, ranks, 6, 2, 2, cfg));
        cfg.optimizer_nvme.reset();
        cfg.offload_optimizer = false;
        offloaded.push_back(train_at<T>(stage, ranks, 6, 2, 2, cfg));
        cfg.reshard_after_forward = false;  // and its modules kept from forward to backward
        offloaded.push_back(train_at<T>(stage, ranks, 6, 2, 2, cfg));
      }
      CHECK(dir.entries().empty());
#endif
      for (const Trained<T>& off : offloaded) {
        CHECK(bitwise_equal(off.master, plain.master));
        CHECK(bitwise_equal(off.params, plain.params));
        CHECK(bitwise_equal(off.m, plain.m));
        CHECK(bitwise_equal(off.v, plain.v));
      }
    }
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    EngineConfig cfg = test_config(2, 1);
    cfg.offload_optimizer = true;
    zp::Engine<Threads, T, 2> engine(comm, model, cfg);
    const auto m = engine.memory();
    CHECK(m.offloaded == m.master + m.optimizer_state);
    CHECK(m.offloaded == engine.layout().shard() * 4 * 3);  // master, m and v of the shard
  });
#if defined(ZP_WITH_AIO)
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    EngineConfig cfg = test_config(2, 1);
    cfg.optimizer_nvme = zp::NvmeOptions{.path = dir.path, .sub_group_size = 1000};
    const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
    zp::Engine<Threads, T, 2> engine(comm, model, cfg);
    measured.start(engine);
    for (int t = 0; t < 2; ++t) zp::test::micro_step(engine, model, (t * 2 + comm.rank()) * 2, 2);
    measured.check(engine, 2);  // the allocator holds none of the state
    const auto m = engine.memory();
    const std::size_t shard = engine.layout().shard();
    CHECK(m.nvme == m.master + m.optimizer_state);
    CHECK(m.nvme == shard * 4 * 3);
    CHECK(m.offloaded == 0);
    const std::size_t C = 2048, buffers = std::min<std::size_t>(4, (shard + C - 1) / C);
    CHECK(m.swap_buffers == (buffers * 3 + 1) * C * 4);  // buffers of 3 fields, one bounce
    CHECK(m.total() == m.params + m.grads + m.buckets + m.swap_buffers);
  });
  zp::test::expect_invalid(
      [&] {
        run_threads(1, [&](Collective<Threads>& comm) {
          Mlp<T> model;
          EngineConfig cfg = test_config(2, 1);
          cfg.param_nvme = zp::NvmeOptions{.path = dir.path};
          zp::Engine<Threads, T, 2> engine(comm, model, cfg);
        });
      },
      {"parameters offloaded (offload_param: nvme) need ZeRO stage 3", "got stage 2"});
#endif
  zp::test::expect_invalid(
      [&] {
        run_threads(1, [&](Collective<Threads>& comm) {
          Mlp<T> model;
          EngineConfig cfg = test_config(2, 1);
          cfg.offload_param = true;
          zp::Engine<Threads, T, 2> engine(comm, model, cfg);
        });
      },
      {"parameters offloaded (offload_param: cpu) need ZeRO stage 3", "got stage 2"});
}

// EngineConfig::weight_decay_filter: after one step from the same weights every element's
// gradient is the same whatever decays, so each element equals, bitwise, the run where every
// parameter decays or the one where none does, as the filter says of its parameter; on every
// stage, 1 and 3 ranks, offloaded and on NVMe (runs of one flag inside segments, pieces and
// sub-groups; layer1.weight is not decayed, so runs also meet mid-module).
TEST_CASE_TEMPLATE("weight decay applies to the parameters the filter names, on every path", T,
                   float, zp::bf16) {
  zp::test::TempDir dir("nvme");
  const auto decays = [](std::string_view n) {
    return !n.ends_with(".bias") && n != "layer1.weight";
  };
  // Which elements of gather_params' order decay.
  std::vector<bool> decayed;
  {
    Mlp<T> m;
    for (const auto& L : m.layers) {
      const std::string name = "layer" + std::to_string(&L - m.layers.data());
      decayed.insert(decayed.end(), L.w.size(), decays(name + ".weight"));
      decayed.insert(decayed.end(), L.b.size(), decays(name + ".bias"));
    }
  }
  const zp::optim::AdamW decay{.lr = 1e-2f, .eps = 1e-4f, .weight_decay = 0.5f};
  for (int stage = 0; stage <= 3; ++stage)
    for (int ranks : {1, 3}) {
      CAPTURE(stage);
      CAPTURE(ranks);
      std::vector<EngineConfig> paths(1, test_config(2, 1));
      paths.push_back(paths[0]);
      paths.back().offload_optimizer = true;
#if defined(ZP_WITH_AIO)
      paths.push_back(paths[0]);
      paths.back().optimizer_nvme =
          zp::NvmeOptions{.path = dir.path, .sub_group_size = 1000, .block_size = 4096};
      if (stage == 3) paths.back().param_nvme = zp::NvmeOptions{.path = dir.path};
#endif
      for (EngineConfig cfg : paths) {
        CAPTURE(cfg.offload_optimizer);
        CAPTURE(cfg.optimizer_nvme.has_value());
        const auto run = [&](float wd) {
          zp::optim::AdamW o = decay;
          o.weight_decay = wd;
          Trained<T> out;
          run_threads(ranks, [&](Collective<Threads>& comm) {
            Mlp<T> model;
            zp::dispatch<zp::Types<T>, zp::Stages<0, 1, 2, 3>>(
                zp::dtype_of<T>, stage,
                [&]<class U, int S>(std::type_identity<U>, std::integral_constant<int, S>) {
                  zp::Engine<Threads, T, S> engine(comm, model, cfg, o);
                  zp::test::micro_step(engine, model, comm.rank() * 2, 2);
                  auto p = engine.gather_params();
                  auto m = engine.gather_master();
                  if (comm.rank() == 0) out = {std::move(p), std::move(m), {}, {}, {}};
                });
          });
          return out;
        };
        const Trained<T> all = run(decay.weight_decay), none = run(0.0f);
        cfg.weight_decay_filter = decays;
        const Trained<T> some = run(decay.weight_decay);
        REQUIRE(some.master.size() == decayed.size());
        std::size_t wrong = 0, told_apart = 0;
        for (std::size_t i = 0; i < decayed.size(); ++i) {
          const Trained<T>& want = decayed[i] ? all : none;
          wrong += some.master[i] != want.master[i] ||
                   std::memcmp(&some.params[i], &want.params[i], sizeof(T)) != 0;
          told_apart += all.master[i] != none.master[i];
        }
        CHECK(wrong == 0);
        CHECK(told_apart > decayed.size() / 2);  // the decay shows in most elements
      }
#if defined(ZP_WITH_AIO)
      CHECK(dir.entries().empty());
#endif
    }
}

// A single rank on the same global batch sums each gradient over the whole batch in one pass,
// N ranks sum partial batches and then average: same math, different rounding (check_close).
TEST_CASE_TEMPLATE("every stage agrees with a single-rank run on the same global batch", T, float,
                   zp::bf16) {
  for (int ranks : {2, 4}) {
    const auto one = train_stage<T>(0, 1, close_steps, 2, 3 * ranks);
    for (int stage : {0, 3}) {
      CAPTURE(ranks);
      CAPTURE(stage);
      const auto s = train_stage<T>(stage, ranks, close_steps, 2, 3);
      const Diff d = diff(one.master, s.master);
      MESSAGE("single rank vs ", ranks, " ranks, stage ", stage, ": |diff| max ", d.max, " mean ",
              d.mean);
      check_close<T>(d);
    }
  }
}

// Hybrid sharding, shard_group_size 2 of 4 ranks: ZeRO over ranks {0, 1} and over {2, 3}, the
// gradient pieces averaged across the two groups. Where ranks r and r + 2 train on the same
// samples the average changes no bit (x + x and the halving are exact), so the run is ZeRO over
// 2 ranks bit for bit; clipping is on, so a norm counted once per replica (not summed over
// them) is checked too, and at stage 3 so is ZeRO++ inside the groups. On four ranks' own
// samples it is ZeRO over 4 ranks up to the order of the sums; without the replicas' average it
// would be neither, and the two groups would part.
TEST_CASE_TEMPLATE("hybrid sharding is ZeRO over a shard group, averaged over its replicas", T,
                   float, zp::bf16) {
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    auto cfg = test_config(3, 2);
    cfg.max_grad_norm = 1e-3f;  // clips every step
    auto hybrid = cfg;
    hybrid.shard_group_size = 2;
    const auto two = train_at<T>(stage, 2, 4, 2, 3, cfg);
    const auto same_data = train_at<T>(stage, 4, 4, 2, 3, hybrid, 2);
    check_same_training(same_data, two);
    if (stage == 3) {  // with ZeRO++ inside each shard group: qwZ, hpZ over it, qgZ's two hops
      auto zpp = cfg;
      zpp.quantized_weights = zp::quant::Format{.bits = zp::quant::Bits::int8, .block = 8};
      zpp.hpz_partition_size = 2;
      zpp.quantized_gradients = zp::quant::Format{.bits = zp::quant::Bits::int4, .block = 8};
      zpp.ranks_per_node = 1;
      auto zpp_hybrid = zpp;
      zpp_hybrid.shard_group_size = 2;
      const auto zpp_two = train_at<T>(stage, 2, 4, 2, 3, zpp);
      const auto zpp_same = train_at<T>(stage, 4, 4, 2, 3, zpp_hybrid, 2);
      CHECK(!bitwise_equal(zpp_two.master, two.master));  // the quantization shows
      CHECK(zpp_same.ranks_agree);
      CHECK(bitwise_equal(zpp_same.params, zpp_two.params));
      CHECK(bitwise_equal(zpp_same.master, zpp_two.master));
    }

    cfg.max_grad_norm = hybrid.max_grad_norm = 0;
    const auto four = train_at<T>(stage, 4, close_steps, 2, 3, cfg);
    const auto own_data = train_at<T>(stage, 4, close_steps, 2, 3, hybrid);
    CHECK(own_data.ranks_agree);
    const Diff d = diff(four.master, own_data.master);
    MESSAGE("hybrid 2 x 2 vs ZeRO over 4, stage ", stage, ": |diff| max ", d.max, " mean ", d.mean);
    check_close<T>(d);
  }
}

// Memory per rank (reported and as allocated) is ZeRO's over the shard group; the group's traffic
// is too, and the replicas move one all_reduce of the gradient shard (P / 2 elements over 2
// ranks: bus bytes 2 (R - 1) / R x P / 2) and the statistics per step, once per accumulation
// window however many micro-steps it has.
TEST_CASE("hybrid sharding's memory and traffic follow the ZeRO formulas over the shard group") {
  for (int gas : {1, 2}) {
    CAPTURE(gas);
    run_threads(4, [&](Collective<Threads>& comm) {
      using E = zp::Engine<Threads, zp::bf16, 3>;
      Mlp<zp::bf16> model;
      auto cfg = test_config(2, gas);
      cfg.shard_group_size = 2;
      const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
      E engine(comm, model, cfg);
      measured.start(engine);
      const int steps = 2;
      for (int t = 0; t < steps * gas; ++t)
        zp::test::micro_step(engine, model, (t * 4 + comm.rank()) * 2, 2);
      measured.check(engine, 2);  // the allocator's bytes: ZeRO's over the shard group
      CHECK(engine.data_parallel().size() == 4);
      CHECK(engine.comm().size() == 2);
      CHECK(engine.comm().rank() == comm.rank() % 2);
      REQUIRE(engine.replicas() != nullptr);
      CHECK(engine.replicas()->size() == 2);
      CHECK(engine.replicas()->rank() == comm.rank() / 2);
      CHECK(engine.grid_shape().dp == 2);
      const auto& L = engine.layout();
      const std::size_t P = L.total(), elem = 2, last = L.module(L.module_count() - 1).size;
      CHECK(engine.memory().model_states() == zp::zero_model_state_bytes(3, P, 2, elem, 2));
      const auto& c = engine.last_step_comm();
      const double bytes = double(P * elem),
                   stats_bus = double(E::statistics_count * sizeof(double));  // 2 (2-1)/2 x
      CHECK(c[CollOp::reduce_scatter].bus_bytes == doctest::Approx(gas * bytes / 2).epsilon(1e-12));
      // forward's and backward's gathers but the last module's second (kept between them)
      CHECK(c[CollOp::all_gather].bus_bytes ==
            doctest::Approx(gas * double((2 * P - last) * elem) / 2).epsilon(1e-12));
      CHECK(c[CollOp::all_reduce].bus_bytes == doctest::Approx(stats_bus));
      const auto& r = engine.replicas()->stats();
      CHECK(r[CollOp::all_reduce].calls ==
            std::uint64_t(steps * (engine.layout().segment_count() + 1)));
      CHECK(r[CollOp::all_reduce].bus_bytes ==
            doctest::Approx(steps * (bytes / 2 + stats_bus)).epsilon(1e-12));
      CHECK(r.total().calls == r[CollOp::all_reduce].calls);
    });
  }
}

// Without the broadcast of initial values each rank keeps its own model's values, and under
// hybrid sharding the replicas take their first group's: every rank holds the master weights of
// ZeRO over that group's two ranks, none its own (each rank's Mlp has a seed of its own).
TEST_CASE("hybrid sharding's replicas start from the first group's own values") {
  const auto own_model = [](int rank) {
    return Mlp<float>({Mlp<float>::inputs, 61, 67, 53, Mlp<float>::classes},
                      zp::test::mlp_seed() + 977 * std::uint64_t(rank));
  };
  const auto masters = [&](int stage, int ranks, int shard_group_size) {
    auto cfg = test_config(2, 1);
    cfg.broadcast_initial_params = false;
    cfg.shard_group_size = shard_group_size;
    std::mutex m;
    std::vector<std::vector<float>> got(static_cast<std::size_t>(ranks));
    run_threads(ranks, [&](Collective<Threads>& comm) {
      auto model = own_model(comm.rank());
      zp::dispatch<zp::Types<float>, zp::Stages<1, 3>>(
          zp::dtype_of<float>, stage,
          [&]<class U, int S>(std::type_identity<U>, std::integral_constant<int, S>) {
            zp::Engine<Threads, float, S> engine(comm, model, cfg);
            auto p = engine.gather_master();
            std::lock_guard lk(m);
            got[std::size_t(comm.rank())] = std::move(p);
          });
    });
    return got;
  };
  // group 1's ranks would hold their pieces of another model
  std::vector<float> third;
  for (const auto& L : own_model(2).layers) {
    third.insert(third.end(), L.w0.begin(), L.w0.end());
    third.insert(third.end(), L.b0.begin(), L.b0.end());
  }
  for (int stage : {1, 3}) {
    CAPTURE(stage);
    const std::vector<float> want = masters(stage, 2, 0)[0];
    const auto all = masters(stage, 4, 2);
    for (std::size_t r = 0; r < all.size(); ++r) {
      CAPTURE(r);
      CHECK(bitwise_equal(all[r], want));
    }
    REQUIRE(third.size() == want.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < want.size(); ++i) differ += want[i] != third[i];
    CHECK(differ > want.size() * 9 / 10);
  }
}

namespace {
// The initial value of element i of a parameter, for the ZeRO-Init tests: from its name and i.
float initial_value(std::string_view name, std::size_t i) {
  return 0.3f *
         zp::test::hash_uniform(zp::test::mlp_seed() ^ std::hash<std::string_view>{}(name), i);
}
}  // namespace

// ZeRO-Init (EngineConfig::initializer): each rank asks for exactly the elements it keeps (at
// stage 3 its pieces: every element asked for once over the ranks of a shard group; below, the
// whole model on every rank), no model holding any value (its value views unbound on every
// rank), and the engine then holds, bit for bit, what it holds from a model holding the same
// values in T, and trains the same: at 1 and 3 ranks, hybrid sharding (4 ranks in groups of 2)
// and stage 3's parameters on NVMe (the initial values written through the swap).
TEST_CASE_TEMPLATE("an initializer gives each rank the elements it keeps, as a model would", T,
                   float, zp::bf16) {
  struct Setup {
    int ranks, shard_group_size = 0;
    bool param_nvme = false;
  };
  zp::test::TempDir drive("init-swap");
  for (int stage = 0; stage <= 3; ++stage)
    for (const Setup setup : {Setup{1}, Setup{3}, Setup{4, 2}, Setup{3, 0, true}}) {
      if ((setup.shard_group_size > 0 && stage == 0) || (setup.param_nvme && stage != 3)) continue;
      const int ranks = setup.ranks;
      CAPTURE(stage);
      CAPTURE(ranks);
      CAPTURE(setup.shard_group_size);
      CAPTURE(setup.param_nvme);
      std::mutex m;
      std::map<std::string, std::vector<int>> asked;  // per parameter: times each element was
      run_threads(ranks, [&](Collective<Threads>& comm) {
        Mlp<T> held, empty;
        for (std::size_t l = 0; l < held.layers.size(); ++l) {
          auto& L = held.layers[l];
          const std::string name = "layer" + std::to_string(l);
          for (std::size_t i = 0; i < L.w0.size(); ++i)
            L.w0[i] = T(initial_value(name + ".weight", i));
          for (std::size_t i = 0; i < L.b0.size(); ++i)
            L.b0[i] = T(initial_value(name + ".bias", i));
          empty.layers[l].w.value.rebind(nullptr);
          empty.layers[l].b.value.rebind(nullptr);
        }
        auto cfg = test_config(2, 1);
        cfg.shard_group_size = setup.shard_group_size;
        if (setup.param_nvme) cfg.param_nvme = zp::NvmeOptions{.path = drive.path};
        auto init_cfg = cfg;
        init_cfg.initializer = [&](std::string_view name, std::size_t first, std::span<float> out) {
          for (std::size_t i = 0; i < out.size(); ++i) out[i] = initial_value(name, first + i);
          std::lock_guard lk(m);
          auto& n = asked[std::string(name)];
          if (n.size() < first + out.size()) n.resize(first + out.size());
          for (std::size_t i = 0; i < out.size(); ++i) ++n[first + i];
        };
        zp::dispatch<zp::Types<T>, zp::Stages<0, 1, 2, 3>>(
            zp::dtype_of<T>, stage,
            [&]<class U, int S>(std::type_identity<U>, std::integral_constant<int, S>) {
              zp::Engine<Threads, T, S> from_model(comm, held, cfg);
              zp::Engine<Threads, T, S> from_init(comm, empty, init_cfg);
              CHECK((from_init.memory().nvme > 0) == setup.param_nvme);
              CHECK(bitwise_equal(from_init.gather_params(), from_model.gather_params()));
              CHECK(bitwise_equal(from_init.gather_master(), from_model.gather_master()));
              for (int t = 0; t < 2; ++t) {
                zp::test::micro_step(from_model, held, (t * ranks + comm.rank()) * 2, 2);
                zp::test::micro_step(from_init, empty, (t * ranks + comm.rank()) * 2, 2);
              }
              CHECK(bitwise_equal(from_init.gather_master(), from_model.gather_master()));
            });
      });
      Mlp<T> shape;
      REQUIRE(asked.size() == 2 * shape.layers.size());
      for (std::size_t l = 0; l < shape.layers.size(); ++l) {
        const std::string name = "layer" + std::to_string(l);
        for (const auto& [suffix, size] : {std::pair{".weight", shape.layers[l].w.size()},
                                           std::pair{".bias", shape.layers[l].b.size()}}) {
          const std::string param = name + suffix;
          const int groups = setup.shard_group_size > 0 ? ranks / setup.shard_group_size : 1;
          const std::vector<int> want(size, stage == 3 ? groups : ranks);
          CHECK_MESSAGE(asked[param] == want, param);
        }
      }
    }
}

TEST_CASE("an initializer that fails or leaves an element unwritten is an error on every rank") {
  run_threads(3, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    auto cfg = test_config(2, 1);
    cfg.initializer = [&](std::string_view name, std::size_t first, std::span<float> out) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = initial_value(name, first + i);
      if (comm.rank() == 1 && name == "layer2.bias") throw std::runtime_error("no such tensor");
    };
    using zp::test::expect_invalid;
    expect_invalid(
        [&] { zp::Engine<Threads, float, 2> e(comm, model, cfg); },
        {"the initializer failed on parameter 'layer2.bias' elements [", "no such tensor"});
    cfg.initializer = [&](std::string_view name, std::size_t first, std::span<float> out) {
      for (std::size_t i = 0; i < out.size(); ++i)
        if (name != "layer1.weight" || first + i != 100) out[i] = initial_value(name, first + i);
    };
    expect_invalid([&] { zp::Engine<Threads, float, 1> e(comm, model, cfg); },
                   {"the initializer left element 100 of parameter 'layer1.weight' NaN"});
    cfg.initializer = [&](std::string_view name, std::size_t first, std::span<float> out) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = initial_value(name, first + i);
      if (comm.rank() == 2 && name == "layer0.weight") throw 7;  // not a std::exception
    };
    expect_invalid([&] { zp::Engine<Threads, float, 2> e(comm, model, cfg); },
                   {"the initializer failed on parameter 'layer0.weight' elements [",
                    "an exception not derived from std::exception"});
  });
}

TEST_CASE("hybrid sharding's bad settings are errors naming the value, on every rank") {
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    const auto with = [](int size) {
      auto c = test_config(2, 1);
      c.shard_group_size = size;
      return c;
    };
    using zp::test::expect_invalid;
    expect_invalid([&] { zp::Engine<Threads, float, 3> e(comm, model, with(3)); },
                   {"shard_group_size 3 does not divide the 4 data-parallel ranks"});
    expect_invalid([&] { zp::Engine<Threads, float, 0> e(comm, model, with(2)); },
                   {"shard_group_size 2", "stage 0"});
    expect_invalid([&] { zp::Engine<Threads, float, 3> e(comm, model, with(-2)); },
                   {"shard_group_size must be >= 0", "got -2"});
    expect_invalid(
        [&] { zp::Engine<Threads, float, 2> e(comm, model, with(comm.rank() == 1 ? 2 : 4)); },
        {"shard_group_size differ (from 2 to 4; rank ", comm.rank() == 1 ? "has 2" : "has 4"});
    // the whole group: plain ZeRO
    zp::Engine<Threads, float, 3> whole(comm, model, with(4));
    CHECK(whole.replicas() == nullptr);
    CHECK(whole.comm().size() == 4);
  });
}

namespace {

template <class T, int Stage>
void check_accounting(int ranks) {
  run_threads(ranks, [&](Collective<Threads>& comm) {
    const int n = comm.size();
    Mlp<T> model;
    auto cfg = test_config(2, 1);
    const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
    zp::Engine<Threads, T, Stage> engine(comm, model, cfg);
    measured.start(engine);
    for (int t = 0; t < 2; ++t) zp::test::micro_step(engine, model, (t * n + comm.rank()) * 2, 2);
    measured.check(engine, n);
    const auto& L = engine.layout();
    const std::size_t P = L.total(), elem = sizeof(T);
    // padding bound: less than ranks * align elements per segment
    CHECK(P >= L.used());
    CHECK(P - L.used() < std::size_t(L.segment_count()) * std::size_t(n) * cfg.align);
    const auto mem = engine.memory();
    CHECK(mem.model_states() == zp::zero_model_state_bytes(Stage, P, n, elem, 2));
    CHECK(mem.params == (Stage < 3 ? P : P / std::size_t(n)) * elem);
    CHECK(mem.master == (Stage < 1 ? P : P / std::size_t(n)) * 4);
    CHECK((mem.buckets > 0) == (Stage >= 2));
    if (Stage == 3) CHECK(mem.gathered_peak <= engine.max_live_params() * elem);

    const auto& c = engine.last_step_comm();
    const double f = double(n - 1) / n, bytes = double(P * elem);
    // Stage 3 gathers each module in forward and again in backward, but the last (the default
    // max_reuse_distance keeps it between the two): 3 Psi, less that module.
    const std::size_t last = L.module(L.module_count() - 1).size;
    const double gathers = Stage == 3 ? double(2 * P - last) / double(P) : 1;
    // the statistics all_reduce of statistics_count doubles
    const double stats_bus =
        double(zp::Engine<Threads, T, Stage>::statistics_count * sizeof(double)) * 2.0 * f;
    if (Stage == 0) {
      CHECK(c[CollOp::all_reduce].bus_bytes ==
            doctest::Approx(2 * f * bytes + stats_bus).epsilon(1e-12));
      CHECK(c[CollOp::reduce_scatter].calls == 0);
      CHECK(c[CollOp::all_gather].calls == 0);
    } else {
      CHECK(c[CollOp::all_reduce].calls == 1);
      CHECK(c[CollOp::all_reduce].bus_bytes == doctest::Approx(stats_bus));
      CHECK(c[CollOp::reduce_scatter].bus_bytes == doctest::Approx(f * bytes).epsilon(1e-12));
      CHECK(c[CollOp::all_gather].bus_bytes == doctest::Approx(gathers * f * bytes).epsilon(1e-12));
    }
    const double total = c.total().bus_bytes - stats_bus;
    CHECK(total == doctest::Approx((1 + gathers) * f * bytes).epsilon(1e-12));
  });
}

}  // namespace

TEST_CASE(
    "per-rank model-state bytes (reported and as allocated) and per-step bus bytes follow the ZeRO "
    "formulas") {
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    check_accounting<zp::bf16, 0>(ranks);
    check_accounting<zp::bf16, 1>(ranks);
    check_accounting<zp::bf16, 2>(ranks);
    check_accounting<zp::bf16, 3>(ranks);
    check_accounting<float, 3>(ranks);
  }
}

TEST_CASE("stage 3 never holds more than the live-parameter cap plus persistent parameters") {
  run_threads(3, [&](Collective<Threads>& comm) {
    Mlp<zp::bf16> model;
    auto cfg = test_config(2, 1);
    cfg.persist_threshold = 500;  // the last layer (53*7+7 = 378) stays gathered
    Mlp<zp::bf16> probe;
    const auto L = zp::Layout(zp::describe_parameters<zp::bf16>(probe), 3,
                              {.bucket_elems = 2048, .first_bucket_elems = 256, .align = 4});
    cfg.max_live_params = L.module(1).size;  // exactly the largest module: no room to prefetch
    zp::Engine<Threads, zp::bf16, 3> engine(comm, model, cfg);
    std::size_t worst = 0, persistent = 0;
    for (int t = 0; t < 3; ++t) {
      std::vector<int> labels;
      model.load(t * 6 + comm.rank() * 2, 2, labels);
      for (int l = 0; l < model.modules(); ++l) {
        auto g = engine.forward(l);
        model.forward(l);
        worst = std::max(worst, engine.memory().gathered);
        persistent = std::max(persistent, engine.memory().persistent);
      }
      model.loss(labels, 1.0f);
      for (int l = model.modules() - 1; l >= 0; --l) {
        auto g = engine.backward(l);
        model.backward(l);
        worst = std::max(worst, engine.memory().gathered);
      }
      engine.step();
    }
    const auto mem = engine.memory();
    CHECK(persistent == L.module(3).size * 2);
    CHECK(mem.gathered_peak <= cfg.max_live_params * 2);
    CHECK(worst <= cfg.max_live_params * 2 + persistent);
    CHECK(worst > persistent);
    // outside the guards nothing but the persistent module stays gathered
    CHECK(!model.layers[1].w.value.bound());
  });
}

// Stage 3's plan (Engine::memory_plan) counts the most the first forward gathers at once with
// its guards in the layout's order. A sequential model (forward 0 .. M-1, backward M-1 .. 0)
// gathers at least that in its steps, whatever the budget, prefetch, persistence and reuse;
// with the defaults (a module and its prefetch, the last module kept) exactly that.
TEST_CASE(
    "stage 3's planned gathers are at most a sequential model's peak, equal with the defaults") {
  const std::uint64_t seed = zp::test::run_seed("engine.test least working set");
  for (int trial = 0; trial < 24; ++trial) {
    const auto x = [&](std::uint64_t k) {
      return zp::test::mix(seed + std::uint64_t(trial) * 64 + k);
    };
    std::vector<int> widths{Mlp<zp::bf16>::inputs};
    for (int l = 0, layers = 2 + int(x(0) % 5); l + 1 < layers; ++l)
      widths.push_back(3 + int(x(std::uint64_t(l) + 1) % 90));
    widths.push_back(Mlp<zp::bf16>::classes);
    auto cfg = test_config(2, 1);
    const bool defaults = trial % 3 == 0;  // 8 of the 24 (a draw could leave too few)
    if (!defaults) {
      constexpr std::array<std::size_t, 3> amounts{0, 1, std::size_t(1) << 20};
      cfg.prefetch = amounts[x(11) % 3];
      cfg.max_reuse_distance = amounts[x(12) % 3];
      cfg.reshard_after_forward = x(13) % 4 != 0;
      cfg.persist_threshold = x(14) % 2 ? 0 : x(15) % 700;
      Mlp<zp::bf16> probe(widths);
      const auto L = zp::Layout(zp::describe_parameters<zp::bf16>(probe), 2,
                                {.bucket_elems = 2048, .first_bucket_elems = 256, .align = 4});
      std::size_t largest = 0, all = 0;  // of the modules that do not persist
      for (int m = 0; m < L.module_count(); ++m)
        if (L.module(m).used > cfg.persist_threshold) {
          largest = std::max(largest, L.module(m).size);
          all += L.module(m).size;
        }
      if (largest > 0 && x(16) % 2) cfg.max_live_params = largest + x(17) % (all - largest + 1);
    }
    CAPTURE(trial);
    CAPTURE(widths.size());
    CAPTURE(cfg.prefetch);
    CAPTURE(cfg.max_reuse_distance);
    CAPTURE(cfg.reshard_after_forward);
    CAPTURE(cfg.persist_threshold);
    CAPTURE(cfg.max_live_params);
    std::size_t planned = 0, persistent = 0, peak = 0;
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model(widths);
      zp::Engine<Threads, zp::bf16, 3> engine(comm, model, cfg);
      for (int t = 0; t < 2; ++t) zp::test::micro_step(engine, model, (t * 2 + comm.rank()) * 2, 2);
      if (comm.rank() != 0) return;
      planned = engine.memory_plan().host.gathered;
      peak = engine.memory().gathered_peak;  // of the modules that do not persist
      const auto& L = engine.layout();
      for (int m = 0; m < L.module_count(); ++m)
        if (L.module(m).used <= cfg.persist_threshold) persistent += L.module(m).size * 2;
    });
    REQUIRE(planned >= persistent);
    CHECK(planned - persistent <= peak);
    if (defaults) CHECK(planned - persistent == peak);
  }
}

// FSDP2's reshard_after_forward = false: a module stays gathered from its forward guard to the
// end of its backward guard. The same values reach every guard, so training is bitwise the
// resharding run's; each module is gathered once a micro-step, not twice, and the gathered
// model (every non-persistent module) is held at the end of forward. Under a cap of two modules
// the modules forward gathered last are still there when backward starts: fewer gathers than
// resharding, more than keeping all.
TEST_CASE_TEMPLATE(
    "without resharding after forward stage 3 trains bitwise the same and gathers once a "
    "micro-step",
    T, float, zp::bf16) {
  Mlp<T> probe;
  const auto L = zp::Layout(
      zp::describe_parameters<T>(probe), 3,
      {.bucket_elems = 4096 / sizeof(T), .first_bucket_elems = 512 / sizeof(T), .align = 4});
  std::size_t modules = 0, two = 0;  // every module's elements; the largest two's
  std::vector<std::size_t> sizes;
  for (int m = 0; m < L.module_count(); ++m) sizes.push_back(L.module(m).size);
  for (std::size_t n : sizes) modules += n;
  std::ranges::sort(sizes, std::greater<>());
  two = sizes[0] + sizes[1];
  for (const int gas : {1, 2}) {
    CAPTURE(gas);
    auto cfg = test_config(2, gas);
    const auto plain = train<T, 3>(3, 3, gas, 2, cfg);
    cfg.reshard_after_forward = false;
    const auto kept = train<T, 3>(3, 3, gas, 2, cfg);
    cfg.max_live_params = two;
    const auto capped = train<T, 3>(3, 3, gas, 2, cfg);
    check_same_training(kept, plain);
    check_same_training(capped, plain);
  }
  // With ZeRO++'s quantized gathers and secondary partition (4 ranks, nodes of 2): backward
  // computes with the forward's dequantized values, which a gather again would give.
  {
    auto cfg = test_config(2, 2);
    cfg.quantized_weights = zp::quant::Format{.bits = zp::quant::Bits::int8, .block = 8};
    cfg.hpz_partition_size = 2;
    const auto plain = train<T, 3>(4, 2, 2, 2, cfg);
    cfg.reshard_after_forward = false;
    const auto kept = train<T, 3>(4, 2, 2, 2, cfg);
    CHECK(bitwise_equal(kept.params, plain.params));
    CHECK(bitwise_equal(kept.master, plain.master));
    CHECK(bitwise_equal(kept.losses, plain.losses));
  }
  // The gathers counted over 4 micro-steps, and the memory in the report and the allocator.
  std::map<int, std::uint64_t> bytes;  // by setting: 0 resharding, 1 keeping all, 2 capped
  for (const int setting : {0, 1, 2})
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<T> model;
      auto cfg = test_config(2, 2);
      cfg.reshard_after_forward = setting == 0;
      cfg.max_reuse_distance = 0;  // resharding: every module, the last one too
      if (setting == 2) cfg.max_live_params = two;
      const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      measured.start(engine);
      CHECK(engine.max_live_params() == (setting == 0   ? 2 * sizes[0]
                                         : setting == 1 ? modules
                                                        : two));
      const auto before = comm.stats()[CollOp::all_gather].bytes;
      for (int t = 0; t < 4; ++t) zp::test::micro_step(engine, model, (t * 3 + comm.rank()) * 2, 2);
      measured.check(engine, 3);
      if (setting == 1) CHECK(engine.memory().gathered_peak == modules * sizeof(T));
      if (comm.rank() == 0) bytes[setting] = comm.stats()[CollOp::all_gather].bytes - before;
    });
  INFO("all_gather bytes over 4 micro-steps: resharding ", bytes[0], ", keeping all ", bytes[1],
       ", capped at two modules ", bytes[2]);
  CHECK(bytes[0] == 4 * 2 * modules * sizeof(T));
  CHECK(bytes[1] == 4 * modules * sizeof(T));
  CHECK(bytes[2] < bytes[0]);
  CHECK(bytes[2] > bytes[1]);
  // Below stage 3 nothing is gathered: an error naming the setting; and the ranks must agree.
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    auto cfg = test_config(2, 1);
    cfg.reshard_after_forward = false;
    zp::test::expect_invalid(
        [&] { zp::Engine<Threads, T, 2> engine(comm, model, cfg); },
        {"reshard_after_forward = false", "needs ZeRO stage 3", "got stage 2"});
    cfg.reshard_after_forward = comm.rank() == 0;
    zp::test::expect_invalid([&] { zp::Engine<Threads, T, 3> engine(comm, model, cfg); },
                             {"configurations differ", "reshard_after_forward="});
  });
}

// DeepSpeed's stage3_max_reuse_distance: module m stays gathered from forward to backward when
// the elements gathered between its two uses, 2 x those of the modules after it, are fewer than
// max_reuse_distance. At each distance where a module's choice flips (2 x its elements after,
// and one more): training bitwise the resharding run's, the engine's answer per module, the
// gathers counted (once a micro-step for a kept module, twice otherwise), the default cap, and
// the kept modules held together at the end of forward.
TEST_CASE_TEMPLATE(
    "a module reused within max_reuse_distance elements stays gathered from forward to backward", T,
    float, zp::bf16) {
  Mlp<T> probe;
  const auto L = zp::Layout(
      zp::describe_parameters<T>(probe), 3,
      {.bucket_elems = 4096 / sizeof(T), .first_bucket_elems = 512 / sizeof(T), .align = 4});
  const int n = L.module_count();
  REQUIRE(n == 4);
  std::vector<std::size_t> after(std::size_t(n), 0);  // parameter elements of the modules past m
  for (int m = n - 2; m >= 0; --m)
    after[std::size_t(m)] = after[std::size_t(m) + 1] + L.module(m + 1).used;
  std::vector<std::size_t> distances = {SIZE_MAX};  // and 0, the last module's 2 x 0
  for (std::size_t a : after) distances.insert(distances.end(), {2 * a, 2 * a + 1});
  auto cfg0 = test_config(2, 2);
  cfg0.max_reuse_distance = 0;  // every module resharded
  const auto plain = train<T, 3>(3, 3, 2, 2, cfg0);
  for (const std::size_t d : distances) {
    CAPTURE(d);
    std::vector<bool> kept;
    std::size_t moved = 0, largest = 0, held = 0, all = 0;  // elements
    for (int m = 0; m < n; ++m) {
      kept.push_back(2 * after[std::size_t(m)] < d);
      const std::size_t size = L.module(m).size;
      moved += (kept.back() ? 1 : 2) * size;
      largest = std::max(largest, size);
      held += kept.back() ? size : 0;
      all += size;
    }
    auto cfg = cfg0;
    cfg.max_reuse_distance = d;
    check_same_training(train<T, 3>(3, 3, 2, 2, cfg), plain);
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<T> model;
      const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      measured.start(engine);
      for (int m = 0; m < n; ++m) CHECK(engine.keeps_after_forward(m) == kept[std::size_t(m)]);
      CHECK(engine.max_live_params() == (held == all ? all : std::max(2 * largest, held)));
      const auto before = comm.stats()[CollOp::all_gather].bytes;
      for (int t = 0; t < 4; ++t) zp::test::micro_step(engine, model, (t * 3 + comm.rank()) * 2, 2);
      CHECK(comm.stats()[CollOp::all_gather].bytes - before == 4 * moved * sizeof(T));
      CHECK(engine.memory().gathered_peak >= held * sizeof(T));
      CHECK(engine.memory().gathered_peak <= engine.max_live_params() * sizeof(T));
      measured.check(engine, 3);
    });
  }
  run_threads(2, [&](Collective<Threads>& comm) {
    auto cfg = test_config(2, 1);
    {  // the default, 1: the last module kept, as FSDP2 keeps its root module
      Mlp<T> model;
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      for (int m = 0; m < n; ++m) CHECK(engine.keeps_after_forward(m) == (m == n - 1));
    }
    cfg.max_reuse_distance = SIZE_MAX;
    {  // below stage 3 nothing is gathered: ignored (a ds_config sets it at every stage)
      Mlp<T> model;
      zp::Engine<Threads, T, 2> engine(comm, model, cfg);
      CHECK(!engine.keeps_after_forward(n - 1));
    }
    cfg.max_reuse_distance = 0;
    cfg.reshard_after_forward = false;  // keeps every module whatever the distance
    {
      Mlp<T> model;
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      for (int m = 0; m < n; ++m) CHECK(engine.keeps_after_forward(m));
      zp::test::expect_invalid([&] { (void)engine.keeps_after_forward(n); },
                               {"module 4 is not one of the model's 4 modules [0, 4)"});
    }
    cfg.reshard_after_forward = true;
    cfg.max_reuse_distance = std::size_t(comm.rank());
    Mlp<T> model;
    zp::test::expect_invalid([&] { zp::Engine<Threads, T, 3> engine(comm, model, cfg); },
                             {"configurations differ", "max_reuse_distance="});
  });
}

// The MLP with its layers numbered as modules in the order `perm` (module k is layer perm[k]),
// but run in layer order: guards that enter modules in another order than the layout's.
template <class T>
struct Shuffled {
  Mlp<T> mlp;
  std::vector<int> perm, module_of;  // module k -> layer; layer -> module
  explicit Shuffled(std::vector<int> p) : perm(std::move(p)), module_of(perm.size()) {
    for (std::size_t k = 0; k < perm.size(); ++k) module_of[std::size_t(perm[k])] = int(k);
  }
  template <class V>
  friend void for_each_parameter(Shuffled& s, V&& visit) {
    for (int k = 0; k < int(s.perm.size()); ++k) {
      auto& layer = s.mlp.layers[std::size_t(s.perm[std::size_t(k)])];
      const std::string name = "layer" + std::to_string(s.perm[std::size_t(k)]);
      visit(name + ".weight", k, layer.w);
      visit(name + ".bias", k, layer.b.value, layer.b.grad);
    }
  }
  // One micro-step on samples [first, first + 2); `inside(m, backward)` runs in each guard.
  template <class E, class F>
  float micro_step(E& e, std::int64_t first, F&& inside) {
    std::vector<int> labels;
    mlp.load(first, 2, labels);
    for (int l = 0; l < mlp.modules(); ++l) {
      auto g = e.forward(module_of[std::size_t(l)]);
      inside(module_of[std::size_t(l)], false);
      mlp.forward(l);
    }
    const float loss = mlp.loss(labels, e.loss_scale());
    for (int l = mlp.modules() - 1; l >= 0; --l) {
      auto g = e.backward(module_of[std::size_t(l)]);
      inside(module_of[std::size_t(l)], true);
      mlp.backward(l);
    }
    e.step();
    return loss;
  }
};

// Trains a Shuffled model of layout `perm` on 3 ranks for 3 optimizer steps of 2 micro-steps at
// the default bucket_slots. In every backward guard it counts the buckets launched so far in the
// micro-step (`late`: guards where fewer than the modules whose backward ended had launched all
// theirs, by micro-step) and the scratch bucket memory. Returns rank 0's losses and parameters
// by name.
struct BucketOrderRun {
  std::vector<float> losses;
  std::map<std::string, std::vector<float>> params;
  std::array<int, 6> late{};
  std::size_t kept = 0, most = 0;  // scratch bytes after the first step; the most in a guard
};
template <class T, int Stage>
BucketOrderRun bucket_order_run(const std::vector<int>& perm) {
  BucketOrderRun out;
  run_threads(3, [&](Collective<Threads>& comm) {
    Shuffled<T> model(perm);
    zp::Engine<Threads, T, Stage> engine(comm, model, test_config(2, 2));
    const zp::Layout& L = engine.layout();
    const auto segments = [&](int m) {
      return std::uint64_t(L.module(m).end_segment - L.module(m).first_segment);
    };
    const auto launched = [&] { return comm.stats()[CollOp::reduce_scatter].calls; };
    BucketOrderRun mine;
    for (int t = 0; t < 6; ++t) {
      const bool reduces = Stage >= 2 || t % 2 == 1;  // stage 1: at the boundary only
      const auto before = launched();
      std::uint64_t ended = 0;  // segments of the modules whose backward ended
      const float loss = model.micro_step(engine, (t * 3 + comm.rank()) * 2, [&](int m, bool b) {
        if (!b) return;
        mine.most = std::max(mine.most, engine.memory().buckets);
        if (t >= 2) CHECK(engine.memory().buckets == mine.kept);
        if (launched() - before < (reduces ? ended : 0)) ++mine.late[std::size_t(t)];
        CHECK(launched() - before <= (reduces ? ended : 0));
        ended += segments(m);
      });
      mine.losses.push_back(loss);
      if (t == 1) mine.kept = engine.memory().buckets;
      if (t >= 2) CHECK(engine.memory().buckets == mine.kept);
    }
    const auto p = engine.gather_params();
    if (comm.rank() != 0) return;
    std::size_t at = 0;
    for (const auto& q : L.params()) {
      auto& v = mine.params[q.name];
      for (std::size_t i = 0; i < q.size; ++i) v.push_back(float(p[at + i]));
      at += q.size;
    }
    out = std::move(mine);
  });
  return out;
}

// Gradient buckets launch in the order the ranks' backward made them ready: with modules laid
// out in another order than backward runs them, the first optimizer step's buckets launch in the
// layout's order (later ones wait; stage 2/3 hold more scratch buckets than bucket_slots for
// them), every later step's as their module's backward guard ends, within bucket_slots. The
// training is bitwise that of the model laid out in backward's order.
TEST_CASE_TEMPLATE("gradient buckets launch in the order backward makes them ready", T, float,
                   zp::bf16) {
  const std::vector<int> in_order = {0, 1, 2, 3}, shuffled = {2, 0, 3, 1};
  const auto check = [&]<int Stage>() {
    const int stage = Stage;
    CAPTURE(stage);
    const BucketOrderRun want = bucket_order_run<T, Stage>(in_order);
    const BucketOrderRun run = bucket_order_run<T, Stage>(shuffled);
    CHECK(want.late == std::array<int, 6>{});
    CHECK(run.late[Stage >= 2 ? 0 : 1] > 0);  // the first micro-step that reduces
    for (std::size_t t = 2; t < run.late.size(); ++t) CHECK(run.late[t] == 0);
    CHECK((run.most > run.kept) == (Stage >= 2));  // stage 1 reduces in the gradient buffer
    CHECK(want.most == want.kept);
    CHECK(run.kept == want.kept);
    CHECK(bitwise_equal(run.losses, want.losses));
    CHECK(run.params == want.params);
  };
  check.template operator()<1>();
  check.template operator()<2>();
  check.template operator()<3>();
}

// Stage 3 learns the order of a micro-step's guards and follows it in the next: with guards
// that do not run in the layout's order, each guard finds the module entered next already being
// gathered (and no other; with prefetch unlimited, every module still to come), the module used
// last in forward is the one kept for backward, nothing is gathered twice but what the ZeRO
// formula gathers twice, and a cap evicts the module backward needs last. Training is bitwise
// the run without prefetch or keeping.
TEST_CASE_TEMPLATE("stage 3 prefetches and keeps modules in the order the last micro-step ran", T,
                   float, zp::bf16) {
  const std::vector<int> perm = {2, 0, 3, 1};  // runs modules 1, 3, 0, 2, then 2, 0, 3, 1
  Shuffled<T> probe(perm);
  const auto L = zp::Layout(
      zp::describe_parameters<T>(probe), 3,
      {.bucket_elems = 4096 / sizeof(T), .first_bucket_elems = 512 / sizeof(T), .align = 4});
  REQUIRE(L.module_count() == 4);
  const auto size = [&](int m) { return L.module(m).size; };
  std::vector<std::pair<int, bool>> order;  // the guards of a micro-step
  for (int l = 0; l < 4; ++l) order.emplace_back(probe.module_of[std::size_t(l)], false);
  for (int l = 3; l >= 0; --l) order.emplace_back(probe.module_of[std::size_t(l)], true);
  std::size_t all = 0;
  for (int m = 0; m < 4; ++m) all += size(m);
  const int last_forward = probe.module_of[3], last_backward = probe.module_of[0];
  // Trains 3 ranks for 6 micro-steps (3 steps of 2) under cfg; from the third on (the first
  // after an optimizer step that followed the learnt order: none left a prefetch behind),
  // `check` runs in every guard, with the guard's place in `order`, and *bytes counts the
  // gathers.
  const auto run = [&](EngineConfig cfg, auto&& check, std::uint64_t* bytes = nullptr) {
    std::vector<float> losses;
    std::vector<T> params;
    run_threads(3, [&](Collective<Threads>& comm) {
      Shuffled<T> model(perm);
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      std::uint64_t before = 0;
      for (int t = 0; t < 6; ++t) {
        if (t == 2) before = comm.stats()[CollOp::all_gather].bytes;
        std::size_t at = 0;
        const float loss = model.micro_step(engine, (t * 3 + comm.rank()) * 2, [&](int m, bool b) {
          CHECK(order[at] == std::pair(m, b));
          if (t >= 2) check(engine, at);
          ++at;
        });
        if (comm.rank() == 0) losses.push_back(loss);
      }
      const auto gathered = comm.stats()[CollOp::all_gather].bytes - before;
      auto p = engine.gather_params();
      if (comm.rank() != 0) return;
      params = std::move(p);
      if (bytes) *bytes = gathered;
    });
    return std::pair(losses, params);
  };
  auto cfg = test_config(2, 2);
  cfg.prefetch = 0;
  cfg.max_reuse_distance = 0;
  const auto plain = run(cfg, [](auto&, std::size_t) {});
  cfg.prefetch = 1;
  // Every module resharded: inside each guard the gathered modules are its own and the next
  // guard's (none after the last; none in forward's last, whose next guard is its backward).
  std::uint64_t bytes = 0;
  const auto resharded = run(
      cfg,
      [&](auto& engine, std::size_t at) {
        const int m = order[at].first;
        const int next = at + 1 < order.size() ? order[at + 1].first : m;
        CAPTURE(at);
        CHECK(engine.memory().gathered == (size(m) + (next != m ? size(next) : 0)) * sizeof(T));
      },
      &bytes);
  CHECK(bytes == 4 * 2 * all * sizeof(T));
  // Prefetching without an element limit under a cap of the whole model: every module a later
  // guard enters is gathered ahead (or, used in forward, again at once for backward), so inside
  // each guard exactly the modules of the guards from it to the end; the same bytes.
  cfg.prefetch = SIZE_MAX;
  cfg.max_live_params = all;
  const auto ahead = run(
      cfg,
      [&](auto& engine, std::size_t at) {
        std::size_t want = 0;
        for (int m = 0; m < 4; ++m)
          if (std::any_of(order.begin() + std::ptrdiff_t(at), order.end(),
                          [&](const auto& e) { return e.first == m; }))
            want += size(m);
        CAPTURE(at);
        CHECK(engine.memory().gathered == want * sizeof(T));
      },
      &bytes);
  CHECK(bytes == 4 * 2 * all * sizeof(T));
  cfg.max_live_params = 0;  // under the default cap (twice the largest module) it stays
  const auto ahead_capped = run(
      cfg,
      [&](auto& engine, std::size_t) {
        CHECK(engine.memory().gathered <= engine.max_live_params() * sizeof(T));
      },
      &bytes);
  CHECK(bytes == 4 * 2 * all * sizeof(T));
  cfg.prefetch = 1;
  // The default distance keeps the module forward runs last (layer 3, module 2), not the
  // layout's last: its second gather is the only one saved.
  cfg.max_reuse_distance = 1;
  const auto kept = run(
      cfg,
      [&](auto& engine, std::size_t) {
        for (int m = 0; m < 4; ++m) CHECK(engine.keeps_after_forward(m) == (m == last_forward));
      },
      &bytes);
  CHECK(bytes == 4 * (2 * all - size(last_forward)) * sizeof(T));
  run_threads(1, [&](Collective<Threads>& comm) {  // before any micro-step: the layout's order
    Shuffled<T> model(perm);
    zp::Engine<Threads, T, 3> engine(comm, model, cfg);
    for (int m = 0; m < 4; ++m) CHECK(engine.keeps_after_forward(m) == (m == 3));
  });
  // Every module kept, under a cap one module short of all: the last forward gather evicts
  // the module backward needs last (layer 0's), which backward then gathers again.
  cfg.reshard_after_forward = false;
  cfg.max_live_params = all - size(probe.module_of[3]);
  const auto capped = run(
      cfg,
      [&](auto& engine, std::size_t) {
        CHECK(engine.memory().gathered <= cfg.max_live_params * sizeof(T));
      },
      &bytes);
  CHECK(bytes == 4 * (all + size(last_backward)) * sizeof(T));
  // A micro-step of more than 8 guards a module (here forward passes without step(), as an
  // evaluation runs) is not recorded: the order before it stands.
  run_threads(1, [&](Collective<Threads>& comm) {
    Shuffled<T> model(perm);
    zp::Engine<Threads, T, 3> engine(comm, model, test_config(2, 1));
    for (int pass = 0; pass < 8; ++pass)
      for (int l = 0; l < 4; ++l) auto g = engine.forward(model.module_of[std::size_t(l)]);
    model.micro_step(engine, 0, [](int, bool) {});  // 36 guards
    for (int m = 0; m < 4; ++m) CHECK(engine.keeps_after_forward(m) == (m == 3));
    model.micro_step(engine, 2, [](int, bool) {});
    for (int m = 0; m < 4; ++m) CHECK(engine.keeps_after_forward(m) == (m == last_forward));
  });
  for (const auto* r : {&resharded, &ahead, &ahead_capped, &kept, &capped}) {
    CHECK(bitwise_equal(r->first, plain.first));
    CHECK(bitwise_equal(r->second, plain.second));
  }
}

TEST_CASE_TEMPLATE(
    "quantized weight gathers (qwZ): every rank computes with each piece's int8 round trip, the "
    "shards stay exact, and the gathers move the quantized bytes",
    T, float, zp::bf16) {
  constexpr int N = 3;
  const zp::quant::Format f{.bits = zp::quant::Bits::int8, .block = 8};
  std::uint64_t plain_bytes = 0, quantized_bytes = 0;
  std::vector<float> plain_losses, quantized_losses;
  double ratio_lo = 1e9, ratio_hi = 0;  // quantized / plain bytes over the modules
  for (const bool quantized : {false, true})
    run_threads(N, [&](Collective<Threads>& comm) {
      Mlp<T> model;
      EngineConfig cfg = test_config(2, 1);
      if (quantized) cfg.quantized_weights = f;
      const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      measured.start(engine);
      const zp::Layout& L = engine.layout();
      std::vector<zp::View<T>*> views;
      zp::visit_parameters<T>(
          model, [&](std::string_view, int, zp::View<T>& v, zp::View<T>&) { views.push_back(&v); });
      std::int64_t scratch = 0;  // the records of 4 modules: 2 in flight, 2 kept
      for (int m = 0; m < L.module_count(); ++m) {
        std::size_t words = 0, elems = 0;
        for (int s = L.module(m).first_segment; s < L.module(m).end_segment; ++s) {
          const std::size_t piece = L.segment(s).piece;
          words += (piece + 3) / 4 + f.blocks(piece);
          elems += piece;
        }
        scratch = std::max(scratch, std::int64_t(4 * (N + 1) * words * 4));
        const double ratio = double(words * 4) / double(elems * sizeof(T));
        if (comm.rank() == 0) {  // the ranks share these
          ratio_lo = std::min(ratio_lo, ratio);
          ratio_hi = std::max(ratio_hi, ratio);
        }
      }
      const auto same = [](const T& a, const T& b) { return std::memcmp(&a, &b, sizeof(T)) == 0; };
      std::uint64_t reference_bytes = 0;  // the test's own all_gathers
      const auto before = comm.stats()[CollOp::all_gather].bytes;
      for (int t = 0; t < 3; ++t) {
        // What each guard must see: every rank's exact piece of each segment (gathered here with
        // a plain all_gather), through quantize -> dequantize, and within the int8 bound of it.
        std::vector<std::vector<T>> expected(std::size_t(L.segment_count()));
        for (int s = 0; s < L.segment_count(); ++s) {
          const auto& g = L.segment(s);
          std::vector<T> exact(g.size);
          comm.all_gather(
              std::span<const T>(
                  engine.partition().template owned<zp::Field::param>(s, zp::Extent::piece).span),
              std::span<T>(exact));
          reference_bytes += exact.size() * sizeof(T);
          auto& e = expected[std::size_t(s)];
          e = exact;
          if (!quantized) continue;
          for (int r = 0; r < N; ++r) {
            const auto in = std::span<const T>(exact).subspan(std::size_t(r) * g.piece, g.piece);
            std::vector<std::uint8_t> codes(f.code_bytes(g.piece));
            std::vector<float> scales(f.blocks(g.piece));
            zp::quant::quantize(in, f, std::span(codes), std::span(scales));
            zp::quant::dequantize(f, std::span<const std::uint8_t>(codes),
                                  std::span<const float>(scales),
                                  std::span(e).subspan(std::size_t(r) * g.piece, g.piece));
            // float64: the int8 bound, plus a few ulps of absmax for the fp32 rounding of the
            // scale, its reciprocal and code x scale (as tests/quantize.test.cpp allows)
            for (std::size_t lo = 0; lo < g.piece; lo += f.block) {
              const std::size_t hi = std::min(g.piece, lo + f.block);
              double absmax = 0;
              for (std::size_t i = lo; i < hi; ++i)
                absmax = std::max(absmax, std::fabs(double(float(in[i]))));
              for (std::size_t i = lo; i < hi; ++i)
                REQUIRE(std::fabs(double(float(e[std::size_t(r) * g.piece + i])) -
                                  double(float(in[i]))) <=
                        absmax / 254 + absmax * 0x1p-21 +
                            (sizeof(T) == 2 ? std::fabs(double(float(in[i]))) / 256 : 0));
            }
          }
        }
        std::vector<int> labels;
        model.load((t * N + comm.rank()) * 2, 2, labels);
        for (int l = 0; l < model.modules(); ++l) {
          auto guard = engine.forward(l);
          for (int s = L.module(l).first_segment; s < L.module(l).end_segment; ++s)
            for (int p : L.segment(s).params) {
              const auto& info = L.params()[std::size_t(p)];
              const zp::View<T>& v = *views[std::size_t(p)];
              for (std::size_t i = 0; i < v.size(); ++i)
                REQUIRE(
                    same(v[i], expected[std::size_t(s)][info.offset - L.segment(s).offset + i]));
            }
          model.forward(l);
        }
        const float loss = model.loss(labels, engine.loss_scale());
        if (comm.rank() == 0) (quantized ? quantized_losses : plain_losses).push_back(loss);
        for (int l = model.modules() - 1; l >= 0; --l) {
          auto guard = engine.backward(l);
          model.backward(l);
        }
        engine.step();
        // The shard is the optimizer's, untouched by the quantization: T of the master weights.
        const auto& P = engine.partition();
        const auto params = P.template buffer<zp::Field::param>();
        const auto master = P.template buffer<zp::Field::master>();
        for (std::size_t i = 0; i < params.size(); ++i) REQUIRE(same(params[i], T(master[i])));
      }
      measured.check(engine, N, false, scratch);
      if (comm.rank() == 0)
        (quantized ? quantized_bytes : plain_bytes) =
            comm.stats()[CollOp::all_gather].bytes - before - reference_bytes;
    });
  // Both runs gather the same modules, the quantized one each as records instead of pieces.
  INFO("engine's all_gather bytes: plain ", plain_bytes, ", quantized ", quantized_bytes,
       "; records / pieces per module ", ratio_lo, " to ", ratio_hi);
  CHECK(plain_bytes > 0);
  CHECK(double(quantized_bytes) >= ratio_lo * double(plain_bytes));
  CHECK(double(quantized_bytes) <= ratio_hi * double(plain_bytes));
  CHECK(quantized_losses.size() == 3);
  for (std::size_t t = 0; t < quantized_losses.size(); ++t)
    CHECK(std::fabs(quantized_losses[t] - plain_losses[t]) <= 0.02f * plain_losses[t]);
}

TEST_CASE_TEMPLATE(
    "a secondary partition (hpZ) trains bitwise as without it, runs the later gathers inside "
    "the node and keeps 1/hpz of the modules",
    T, float, zp::bf16) {
  for (const bool quantized : {false, true}) {
    CAPTURE(quantized);
    auto cfg = test_config(2, 2);  // accumulation: later micro-batches gather the modules again
    if (quantized)
      cfg.quantized_weights = zp::quant::Format{.bits = zp::quant::Bits::int8, .block = 8};
    const auto plain = train<T, 3>(4, 3, 2, 2, cfg);
    cfg.hpz_partition_size = 2;
    check_same_training(train<T, 3>(4, 3, 2, 2, cfg), plain);
  }
  // The same gathers, counted: each module's first gather of a step over all 4 ranks, the rest
  // inside the node; the secondary shards in the report and the allocator.
  std::uint64_t plain_bytes = 0, all_bytes = 0, node_bytes = 0, first_bytes = 0;
  for (const int hpz : {1, 2})
    run_threads(4, [&](Collective<Threads>& comm) {
      Mlp<T> model;
      auto cfg = test_config(2, 2);
      cfg.hpz_partition_size = hpz;
      const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
      zp::Engine<Threads, T, 3> engine(comm, model, cfg);
      measured.start(engine);
      REQUIRE((engine.hpz_group() != nullptr) == (hpz == 2));
      const auto before = comm.stats()[CollOp::all_gather].bytes;
      for (int t = 0; t < 4; ++t) zp::test::micro_step(engine, model, (t * 4 + comm.rank()) * 2, 2);
      const auto gathered = comm.stats()[CollOp::all_gather].bytes - before;
      measured.check(engine, 4);
      const zp::Layout& L = engine.layout();
      std::size_t modules = 0;  // every module's elements, padded
      for (int m = 0; m < L.module_count(); ++m) modules += L.module(m).size;
      CHECK(engine.memory().secondary == (hpz == 2 ? modules / 2 * sizeof(T) : 0));
      if (comm.rank() != 0) return;
      if (hpz == 1) {
        plain_bytes = gathered;
      } else {
        all_bytes = gathered;
        node_bytes = engine.hpz_group()->stats()[CollOp::all_gather].bytes;
        first_bytes = 2 * modules * sizeof(T);  // 2 steps, each module once over all ranks
      }
    });
  INFO("all_gather bytes: without hpZ ", plain_bytes, "; with: ", all_bytes, " over all ranks, ",
       node_bytes, " inside the node");
  CHECK(all_bytes == first_bytes);
  CHECK(all_bytes + node_bytes == plain_bytes);
  CHECK(node_bytes > all_bytes);
  // An engine with a node of 2 ranks at `Stage` on `ranks` ranks.
  const auto hpz2 = [&]<int Stage>(std::integral_constant<int, Stage>, int ranks) {
    return [=] {
      run_threads(ranks, [&](Collective<Threads>& comm) {
        Mlp<T> model;
        auto cfg = test_config(2, 1);
        cfg.hpz_partition_size = 2;
        zp::Engine<Threads, T, Stage> engine(comm, model, cfg);
      });
    };
  };
  // With the smallest module persistent (gathered for good), the others keep secondary shards:
  // the plan the memory check reads counts those, as the engine holds them.
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    auto cfg = test_config(2, 2);
    cfg.hpz_partition_size = 2;
    cfg.persist_threshold = std::size_t(-1);
    {
      Mlp<T> probe_model;
      const zp::Engine<Threads, T, 3> probe(comm, probe_model, cfg);  // every module persists
      const zp::Layout& L = probe.layout();
      for (int m = 0; m < L.module_count(); ++m)
        cfg.persist_threshold = std::min(cfg.persist_threshold, L.module(m).used);
    }
    zp::Engine<Threads, T, 3> engine(comm, model, cfg);
    for (int t = 0; t < 2; ++t) zp::test::micro_step(engine, model, (t * 4 + comm.rank()) * 2, 2);
    const zp::Layout& L = engine.layout();
    std::size_t kept = 0, persistent = 0;
    for (int m = 0; m < L.module_count(); ++m)
      (L.module(m).used <= cfg.persist_threshold ? persistent : kept) += L.module(m).size / 2;
    REQUIRE(persistent > 0);
    REQUIRE(kept > 0);
    CHECK(engine.memory().secondary == kept * sizeof(T));
    CHECK(engine.memory_plan().host.secondary == kept * sizeof(T));
  });
  zp::test::expect_invalid(hpz2(std::integral_constant<int, 3>{}, 3),
                           {"hpz_partition_size 2 does not divide the 3 data-parallel ranks"});
  zp::test::expect_invalid(
      hpz2(std::integral_constant<int, 2>{}, 2),
      {"secondary partition (zero_hpz_partition_size 2) needs ZeRO stage 3", "got stage 2"});
}

TEST_CASE_TEMPLATE(
    "quantized gradients (qgZ) train close to the exact ones, and only their second hop crosses "
    "nodes",
    T, float, zp::bf16) {
  constexpr int N = 4, steps = 3;
  const zp::quant::Format int8{.bits = zp::quant::Bits::int8, .block = 8},
      int4{.bits = zp::quant::Bits::int4, .block = 8};
  for (const int stage : {2, 3})
    for (const int per_node : {0, 2})
      for (const auto& f : {int8, int4}) {
        CAPTURE(stage);
        CAPTURE(per_node);
        CAPTURE(int(f.bits));
        std::vector<float> losses[2];
        for (const bool quantized : {false, true})
          run_threads(N, [&](Collective<Threads>& comm) {
            Mlp<T> model;
            auto cfg = test_config(2, 1);
            cfg.ranks_per_node = per_node;
            if (quantized) cfg.quantized_gradients = f;
            const zp::test::MeasuredMemory<zp::MemorySpace::host> measured;
            auto run = [&]<int Stage>(std::integral_constant<int, Stage>) {
              zp::Engine<Threads, T, Stage> engine(comm, model, cfg);
              measured.start(engine);
              const zp::Layout& L = engine.layout();
              const int nodes = per_node ? N / per_node : 1;
              std::uint64_t node_bytes = 0, cross_bytes = 0;  // a step's, by the formula
              for (int s = 0; s < L.segment_count(); ++s) {
                const std::size_t rw = zp::quant::record_words(f, L.segment(s).piece);
                node_bytes += N * rw * 4;
                cross_bytes += std::uint64_t(nodes) * rw * 4;
              }
              for (int t = 0; t < steps; ++t) {
                float loss = 0;
                zp::test::micro_step(engine, model, (t * N + comm.rank()) * 2, 2, &loss);
                if (comm.rank() == 0) losses[quantized].push_back(loss);
                if (!quantized) continue;
                const auto& last = engine.last_step_comm();
                CHECK(last[CollOp::reduce_scatter].bytes == 0);
                CHECK(engine.qgz_node_group()->stats()[CollOp::all_to_all].bytes ==
                      node_bytes * std::uint64_t(t + 1));
                CHECK(engine.qgz_cross_group()->stats()[CollOp::all_to_all].bytes ==
                      cross_bytes * std::uint64_t(t + 1));
              }
              measured.check(engine, N);
            };
            if (stage == 2)
              run(std::integral_constant<int, 2>{});
            else
              run(std::integral_constant<int, 3>{});
          });
        for (int t = 0; t < steps; ++t)
          CHECK(std::fabs(losses[1][std::size_t(t)] - losses[0][std::size_t(t)]) <=
                0.05f * losses[0][std::size_t(t)]);
      }
  zp::test::expect_invalid(
      [&] {
        run_threads(2, [&](Collective<Threads>& comm) {
          Mlp<T> model;
          auto cfg = test_config(2, 1);
          cfg.quantized_gradients = zp::zero_quantized_gradients;
          zp::Engine<Threads, T, 1> engine(comm, model, cfg);
        });
      },
      {"quantized gradients (zero_quantized_gradients) need ZeRO stage 2 or 3", "got stage 1"});
}

namespace {

template <int Stage>
void check_overflow_skip(int ranks) {
  run_threads(ranks, [&](Collective<Threads>& comm) {
    const int n = comm.size(), r = comm.rank();
    Mlp<zp::fp16> model;
    auto cfg = test_config(2, 1);
    cfg.loss_scaler = zp::LossScaler::dynamic({.initial_scale = 1024.0f, .hysteresis = 1});
    zp::Engine<Threads, zp::fp16, Stage> engine(comm, model, cfg);
    for (int t = 0; t < 3; ++t)
      CHECK(zp::test::micro_step(engine, model, (t * n + r) * 2, 2).applied);
    const auto& P = engine.partition();
    auto copy = [](auto span) {
      return std::vector<std::remove_cv_t<typename decltype(span)::element_type>>(span.begin(),
                                                                                  span.end());
    };
    const auto params = copy(P.template buffer<zp::Field::param>());
    const auto master = copy(P.template buffer<zp::Field::master>()),
               m = copy(P.template buffer<zp::Field::state>(0)),
               v = copy(P.template buffer<zp::Field::state>(1));
    model.poison = r == n - 1;  // only the last rank sees an inf
    const auto res = zp::test::micro_step(engine, model, (3 * n + r) * 2, 2);
    model.poison = false;
    CHECK(res.overflow);
    CHECK(!res.applied);
    CHECK(res.loss_scale == 512.0f);
    CHECK(engine.steps() == 3);
    CHECK(engine.loss_scaler().state().skipped == 1);
    CHECK(bitwise_equal(copy(P.template buffer<zp::Field::param>()), params));
    CHECK(bitwise_equal(copy(P.template buffer<zp::Field::master>()), master));
    CHECK(bitwise_equal(copy(P.template buffer<zp::Field::state>(0)), m));
    CHECK(bitwise_equal(copy(P.template buffer<zp::Field::state>(1)), v));
    const auto next = zp::test::micro_step(engine, model, (4 * n + r) * 2, 2);
    CHECK(next.applied);
    CHECK(engine.steps() == 4);
  });
}

}  // namespace

TEST_CASE("an inf in one rank's gradient skips the step on every rank and halves the loss scale") {
  for (int ranks : {1, 3}) {
    check_overflow_skip<0>(ranks);
    check_overflow_skip<1>(ranks);
    check_overflow_skip<2>(ranks);
    check_overflow_skip<3>(ranks);
  }
}

namespace {

// With a constant scale (none: bf16/fp32; fixed), overflowing steps in a row end training at
// max_skipped_in_row, on every rank, before anything changes; an applied step restarts the count.
template <class T, int Stage>
void check_skipped_in_row(int ranks, zp::LossScaler scaler) {
  run_threads(ranks, [&](Collective<Threads>& comm) {
    const int n = comm.size(), r = comm.rank();
    Mlp<T> model;
    auto cfg = test_config(2, 1);
    cfg.loss_scaler = scaler;
    zp::Engine<Threads, T, Stage> engine(comm, model, cfg);
    int t = 0;
    auto step = [&](bool poison) {
      model.poison = poison && r == (t % n);  // the rank that overflows moves around
      const auto res = zp::test::micro_step(engine, model, (t++ * n + r) * 2, 2);
      model.poison = false;
      CHECK(res.applied == !poison);
      CHECK(res.overflow == poison);
      return res;
    };
    step(false);
    for (int k = 0; k < 4; ++k) step(true);
    CHECK(engine.loss_scaler().state().skipped_in_row == 4);
    step(false);  // applied: the count starts again
    CHECK(engine.loss_scaler().state().skipped_in_row == 0);
    for (int k = 0; k < 4; ++k) step(true);
    const auto params = engine.gather_params();
    const auto state = engine.loss_scaler().state();
    model.poison = r == 0;
    zp::test::expect_invalid([&] { (void)zp::test::micro_step(engine, model, (t * n + r) * 2, 2); },
                             {"loss scaler: 5 steps in a row had inf/nan gradients and were "
                              "skipped (9 of 11 steps skipped, loss scale ",
                              "max_skipped_in_row (now 5"});
    model.poison = false;
    CHECK(engine.loss_scaler().state() == state);  // refused before the count changed
    CHECK(state.skipped == 8);
    CHECK(bitwise_equal(engine.gather_params(), params));
    CHECK(engine.steps() == 2);
    step(false);  // a clean step after the error trains on
    CHECK(engine.steps() == 3);
    CHECK_FALSE(bitwise_equal(engine.gather_params(), params));
  });
}

}  // namespace

TEST_CASE("overflowing steps in a row under a constant scale end training with an error") {
  check_skipped_in_row<float, 0>(2, zp::LossScaler::none(5));
  check_skipped_in_row<zp::bf16, 3>(3, zp::LossScaler::none(5));
  check_skipped_in_row<zp::fp16, 2>(2, zp::LossScaler::fixed(8.0f, 5));
  CHECK(zp::LossScaler::none().max_skipped_in_row() == 100);
  CHECK(zp::LossScaler::fixed(2.0f).max_skipped_in_row() == 100);
  CHECK(zp::LossScaler::dynamic().max_skipped_in_row() == 0);  // it stops at min_scale
}

TEST_CASE("fp16 with dynamic loss scaling backs off from overflow and learns") {
  // From 2^16 the first steps overflow: they are skipped and the scale falls until steps apply.
  std::vector<zp::fp16> params;
  zp::LossScaler::State scaler;
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<zp::fp16> model;
    auto cfg = test_config(4, 1);
    cfg.loss_scaler = zp::LossScaler::dynamic({.initial_scale = 65536.0f, .window = 5});
    zp::Engine<Threads, zp::fp16, 3> engine(comm, model, cfg, zp::optim::AdamW{.lr = 1e-2f});
    for (int t = 0; t < 30; ++t) zp::test::micro_step(engine, model, (t * 2 + comm.rank()) * 4, 4);
    auto p = engine.gather_params();
    if (comm.rank() == 0) {
      params = std::move(p);
      scaler = engine.loss_scaler().state();
      CHECK(engine.steps() + scaler.skipped == 30);
    }
  });
  const double before = held_out_loss<zp::fp16>({}), after = held_out_loss(params);
  INFO("held-out loss ", before, " -> ", after, ", skipped ", scaler.skipped, ", scale ",
       scaler.scale);
  CHECK(scaler.skipped > 0);
  CHECK(after < before);
}

TEST_CASE("the batch triad follows DeepSpeed's rules with clear errors") {
  using zp::BatchConfig;
  using zp::resolve_batch;
  auto r = resolve_batch({.train_batch_size = 32, .micro_batch_per_rank = 2}, 4);
  CHECK(r.gradient_accumulation_steps == 4);
  r = resolve_batch({.train_batch_size = 32, .gradient_accumulation_steps = 2}, 4);
  CHECK(r.micro_batch_per_rank == 4);
  r = resolve_batch({.micro_batch_per_rank = 3, .gradient_accumulation_steps = 2}, 4);
  CHECK(r.train_batch_size == 24);
  r = resolve_batch({.train_batch_size = 8}, 4);
  CHECK((r.micro_batch_per_rank == 2 && r.gradient_accumulation_steps == 1));
  r = resolve_batch({.micro_batch_per_rank = 5}, 3);
  CHECK((r.train_batch_size == 15 && r.gradient_accumulation_steps == 1));
  CHECK_THROWS_WITH_AS(
      resolve_batch(
          {.train_batch_size = 30, .micro_batch_per_rank = 2, .gradient_accumulation_steps = 4}, 4),
      doctest::Contains("2 * 4 * 4 = 32"), zp::Error);
  CHECK_THROWS_WITH_AS(resolve_batch({.gradient_accumulation_steps = 4}, 4),
                       doctest::Contains("give train_batch_size"), zp::Error);
  CHECK_THROWS_WITH_AS(resolve_batch({.train_batch_size = 30, .micro_batch_per_rank = 4}, 4),
                       doctest::Contains("not a multiple"), zp::Error);
  CHECK_THROWS_AS(resolve_batch({.train_batch_size = -1}, 4), zp::Error);
}

TEST_CASE(
    "a layout that differs between ranks is a clear error on every rank naming the parameter") {
  // Every rank's error when rank `odd` builds its Mlp with `widths`, the others the default.
  const auto errors_when = [](int odd, std::vector<int> widths) {
    std::mutex m;
    std::vector<std::string> errors;
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<float> model(comm.rank() == odd ? widths : std::vector<int>{13, 61, 67, 53, 7});
      try {
        zp::Engine<Threads, float, 2> engine(comm, model, test_config(2, 1));
      } catch (const zp::Error& e) {
        std::lock_guard lk(m);
        errors.push_back(e.what());
      }
    });
    return errors;
  };
  auto errors = errors_when(1, {13, 61, 68, 53, 7});
  const auto has = [&](const std::string& part) {
    return std::count_if(errors.begin(), errors.end(),
                         [&](const std::string& e) { return e.find(part) != std::string::npos; });
  };
  REQUIRE(errors.size() == 3);
  // layer1.weight is the first parameter that differs (61 x 67 against 61 x 68).
  CHECK(has("models differ between ranks") == 3);
  CHECK(has("the first parameter that differs is #2") == 3);
  CHECK(has("'layer1.weight' (module 1, 4148 elements)") == 1);  // rank 1 has 61 x 68

  // A rank with two layers fewer: its first four parameters agree with the others', the fifth
  // (layer2.weight) it does not have.
  errors = errors_when(2, {13, 61, 67});
  REQUIRE(errors.size() == 3);
  CHECK(has("rank 2 has 4 parameters") == 1);
  CHECK(has("the first difference is parameter #4, which this rank does not have") == 1);
  CHECK(has("the first parameter that differs is #4, on this rank 'layer2.weight'") == 2);
}

TEST_CASE("parameters never touched by backward count as zero gradients instead of hanging") {
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    zp::Engine<Threads, float, 2> engine(comm, model, test_config(2, 1));
    forward_all(engine, model, comm.rank() * 2);
    for (int l = model.modules() - 1; l >= 2; --l) {  // layers 0 and 1 frozen this time
      auto g = engine.backward(l);
      model.backward(l);
    }
    const auto r = engine.step();
    CHECK(r.applied);
  });
}

// ---- teardown, wrong call sequences, cross-rank agreement (the reliability issue) ------------

namespace {

// Forward and backward through every module of the MLP without step(): the backward guards
// launch their buckets' reductions, which are still in flight when this returns.
template <class E, class T>
void forward_backward(E& e, Mlp<T>& m, std::int64_t first, int throw_in_backward_of = -1) {
  forward_all(e, m, first);
  for (int l = m.modules() - 1; l >= 0; --l) {
    auto g = e.backward(l);
    m.backward(l);
    if (l == throw_in_backward_of) throw std::runtime_error("model failed in backward");
  }
}

// qgz: 4 ranks as 2 nodes of 2 with quantized gradients, whose two-hop reductions are in flight.
template <int Stage>
void destroy_in_flight(int reps, bool qgz = false) {
  const int ranks = qgz ? 4 : 3;
  EngineConfig cfg = test_config(2, 1);
  if (qgz) {
    cfg.quantized_gradients = zp::zero_quantized_gradients;
    cfg.ranks_per_node = 2;
  }
  for (int rep = 0; rep < reps; ++rep)
    run_threads(ranks, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      {
        zp::Engine<Threads, zp::bf16, Stage> engine(comm, model, cfg);
        zp::test::micro_step(engine, model, comm.rank() * 2, 2);
        forward_backward(engine, model, 6 + comm.rank() * 2);
      }  // left between backward and step: the reductions must finish before the buckets go
      CHECK(!model.layers[0].w.value.bound());
      // The communicator is still in step: a collective after the teardown sums correctly.
      std::int64_t x = 1;
      comm.all_reduce(std::span<std::int64_t>(&x, 1));
      CHECK(x == ranks);
    });
}

template <int Stage>
void exception_in_backward(int reps) {
  for (int rep = 0; rep < reps; ++rep) {
    // Every rank throws in the same guard and catches outside the engine's scope.
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<float> model;
      try {
        zp::Engine<Threads, float, Stage> engine(comm, model, test_config(2, 1));
        forward_backward(engine, model, comm.rank() * 2, /*throw_in_backward_of=*/1);
        FAIL("not reached");
      } catch (const std::runtime_error& e) {
        CHECK(std::string(e.what()) == "model failed in backward");
      }
    });
    // Caught inside the engine's scope: the incomplete micro-step is never reduced or applied,
    // and the engine says so on its next call.
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<float> model;
      zp::Engine<Threads, float, Stage> engine(comm, model, test_config(2, 1));
      const auto params = [&] {  // read where they are (stage 3: this rank's shard)
        const auto p = engine.partition().template buffer<zp::Field::param>();
        return std::vector<float>(p.begin(), p.end());
      };
      const auto before = params();
      try {
        forward_backward(engine, model, comm.rank() * 2, 2);
      } catch (const std::runtime_error&) {
      }
      zp::test::expect_invalid(
          [&] { engine.step(); },
          {"engine: unusable since an exception ended the backward guard of module 2"});
      zp::test::expect_invalid([&] { (void)engine.forward(0); }, {"unusable"});
      CHECK(engine.steps() == 0);
      zp::test::expect_invalid([&] { (void)engine.gather_params(); }, {"unusable"});
      CHECK(params() == before);  // nothing was applied
    });
    // Only rank 0 fails: the others get an error in bounded time, and nothing leaks or races.
    CHECK_THROWS_WITH_AS(
        run_threads(
            3,
            [&](Collective<Threads>& comm) {
              Mlp<float> model;
              zp::Engine<Threads, float, Stage> engine(comm, model, test_config(2, 1));
              forward_backward(engine, model, comm.rank() * 2, comm.rank() == 0 ? 1 : -1);
              engine.step();
            },
            World::Options{.timeout = std::chrono::seconds(60)}),
        doctest::Contains("model failed in backward"), std::runtime_error);
  }
}

}  // namespace

TEST_CASE("an engine destroyed while its reductions are in flight completes them first") {
  destroy_in_flight<0>(4);
  destroy_in_flight<1>(4);
  destroy_in_flight<2>(4);
  destroy_in_flight<3>(4);
  destroy_in_flight<2>(2, true);
  destroy_in_flight<3>(2, true);
}

TEST_CASE("an exception inside a backward guard leaves nothing in flight and poisons no data") {
  exception_in_backward<0>(2);
  exception_in_backward<1>(2);
  exception_in_backward<2>(2);
  exception_in_backward<3>(2);
}

TEST_CASE_TEMPLATE("wrong call sequences are errors naming the module, the guard or the step", E,
                   zp::Engine<Threads, float, 0>, zp::Engine<Threads, float, 1>,
                   zp::Engine<Threads, float, 2>, zp::Engine<Threads, float, 3>) {
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    E engine(comm, model, test_config(2, 1));
    if constexpr (E::stage >= 2)  // the gradients need the guards: none ran
      zp::test::expect_invalid([&] { engine.step(); }, {"no backward guard ran"});
    forward_all(engine, model, comm.rank() * 2);
    {
      auto open = engine.forward(1);
      zp::test::expect_invalid([&] { engine.step(); }, {"step() called in optimizer step 1",
                                                        "forward guard of module 1 is still open"});
    }
    for (int l = model.modules() - 1; l >= 2; --l) {
      auto g = engine.backward(l);
      model.backward(l);
    }
    zp::test::expect_invalid([&] { (void)engine.backward(3); },
                             {"backward(3) entered a second time in optimizer step 1"});
    {
      auto g = engine.backward(1);
      model.backward(1);
      zp::test::expect_invalid([&] { engine.step(); },
                               {"backward guard of module 1 is still open"});
    }
    {
      auto g = engine.backward(0);
      model.backward(0);
    }
    CHECK(engine.step().applied);
    // A window with no backward: refused with nothing changed, and the window goes on.
    const auto before = engine.gather_master();
    forward_all(engine, model, 4 + comm.rank() * 2);
    zp::test::expect_invalid([&] { engine.step(); },
                             {"step() ends optimizer step 2", "no backward guard ran"});
    CHECK(engine.gather_master() == before);
    for (int l = model.modules() - 1; l >= 0; --l) {
      auto g = engine.backward(l);
      model.backward(l);
    }
    CHECK(engine.step().applied);
    CHECK(engine.gather_master() != before);
  });
}

TEST_CASE_TEMPLATE("a guard that outlives its engine ends doing nothing", E,
                   zp::Engine<Threads, float, 0>, zp::Engine<Threads, float, 3>) {
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    auto engine = std::make_unique<E>(comm, model, test_config(2, 1));
    forward_all(*engine, model, comm.rank() * 2);
    auto g = engine->backward(model.modules() - 1);
    auto f = engine->forward(0);
    engine.reset();  // ASan: the guards' ends must not touch it
    CHECK(!model.layers[0].w.value.bound());
  });
}

TEST_CASE("a rank that skips step() is an error naming step() on every rank") {
  CHECK_THROWS_WITH_AS(
      run_threads(
          2,
          [&](Collective<Threads>& comm) {
            Mlp<float> model;
            zp::Engine<Threads, float, 2> engine(comm, model, test_config(2, 1));
            forward_backward(engine, model, comm.rank() * 2);
            if (comm.rank() == 0) engine.step();
            forward_backward(engine, model, 4 + comm.rank() * 2);  // rank 1 went on without step()
            engine.step();
          },
          World::Options{.timeout = std::chrono::seconds(60)}),
      doctest::Contains("call step() after every micro-step"), zp::Error);
}

TEST_CASE("settings that must agree across ranks are checked, naming what differs") {
  auto differs = [](auto make_config, auto make_optimizer, const char* part) {
    std::mutex m;
    std::vector<std::string> errors;
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<float> model;
      try {
        zp::Engine<Threads, float, 1> engine(comm, model, make_config(comm.rank()),
                                             make_optimizer(comm.rank()));
      } catch (const zp::Error& e) {
        std::lock_guard lk(m);
        errors.push_back(e.what());
      }
    });
    REQUIRE(errors.size() == 3);
    for (const auto& e : errors) CHECK_MESSAGE(e.find(part) != std::string::npos, e);
  };
  const auto same_cfg = [](int) { return test_config(2, 1); };
  const auto same_opt = [](int) { return zp::optim::AdamW{}; };
  differs([](int r) { return test_config(2, r == 2 ? 2 : 1); }, same_opt, "differ in their batch");
  differs(
      same_cfg, [](int r) { return zp::optim::AdamW{.weight_decay = r == 1 ? 0.1f : 0.01f}; },
      "differ in their optimizer (this rank: AdamW(");
  differs(
      [](int r) {
        auto c = test_config(2, 1);
        c.max_grad_norm = r == 0 ? 1.0f : 0.0f;
        return c;
      },
      same_opt, "clipping or loss scaling");
  differs(
      [](int r) {
        auto c = test_config(2, 1);
        c.align = r == 0 ? 8 : 4;
        return c;
      },
      same_opt, "the parameters agree but their bucket layout does not");
  differs(
      [](int r) {
        auto c = test_config(2, 1);
        if (r == 1)
          c.weight_decay_filter = [](std::string_view n) { return !n.ends_with(".bias"); };
        return c;
      },
      same_opt, "differ in their parameters that take weight decay (this rank: ");
}

// On a grid the replica's TP x PP ranks hold different parts (here: Mlps of different widths),
// but step together: clipping differing between pipeline stages is an error on every rank.
TEST_CASE("settings that differ across a replica's pipeline stages are an error on every rank") {
  for (const bool differ : {false, true}) {
    CAPTURE(differ);
    std::mutex m;
    std::vector<std::string> errors;
    run_threads(4, [&](Collective<Threads>& world) {
      zp::ProcessGrid<Threads> grid(world, {.dp = 2, .tp = 1, .pp = 2});
      const int stage = grid.coords().pp;
      Mlp<float> model(stage == 0 ? std::vector<int>{8, 16, 8} : std::vector<int>{8, 4});
      auto cfg = test_config(2, 1);
      cfg.max_grad_norm = differ && stage == 1 ? 0.0f : 1.0f;
      try {
        zp::Engine<Threads, float, 2> engine(grid, model, cfg);
      } catch (const zp::Error& e) {
        std::lock_guard lk(m);
        errors.push_back(e.what());
      }
    });
    REQUIRE(errors.size() == (differ ? 4 : 0));
    for (const auto& e : errors)
      CHECK_MESSAGE(e.find("differ in their clipping or loss scaling") != std::string::npos, e);
  }
}

// ZeRO++ on a tensor-parallel grid keeps the replicated parameters alike only if every TP rank
// quantizes them alike (layout.hpp's by_tp_kind): quantization on some TP ranks only, or TP
// ranks laying out the replicated parameters differently (another align, another model part),
// is an error on every rank, each DP group agreeing inside; as is a setting on one rank of a DP
// group (named there; the other group's ranks, waiting in the replica's check, are told their
// communicator lost those ranks). Without quantization TP ranks may lay out differently.
TEST_CASE(
    "ZeRO++ quantization that differs between tensor-parallel ranks is an error on every rank") {
  enum class Case {
    weights_on_tp1,
    gradients_on_tp1,
    weights_on_rank3,
    weights_on_dp0,
    align,
    widths,
    plain
  };
  for (const Case k : {Case::weights_on_tp1, Case::gradients_on_tp1, Case::weights_on_rank3,
                       Case::weights_on_dp0, Case::align, Case::widths, Case::plain}) {
    CAPTURE(int(k));
    std::mutex m;
    std::vector<std::pair<int, std::string>> errors;  // by TP rank
    run_threads(4, [&](Collective<Threads>& world) {
      zp::ProcessGrid<Threads> grid(world, {.dp = 2, .tp = 2, .pp = 1});
      const bool tp1 = grid.coords().tp == 1;
      auto cfg = test_config(2, 1);
      if (k != Case::plain) cfg.quantized_weights = zp::zero_quantized_weights;
      if (k == Case::weights_on_tp1 && !tp1) cfg.quantized_weights.reset();
      if (k == Case::weights_on_rank3 && world.rank() != 3) cfg.quantized_weights.reset();
      if (k == Case::weights_on_dp0 && grid.coords().dp != 0) cfg.quantized_weights.reset();
      if (k == Case::gradients_on_tp1) {
        cfg.quantized_weights.reset();
        if (tp1) cfg.quantized_gradients = zp::zero_quantized_gradients;
      }
      if ((k == Case::align || k == Case::plain) && tp1) cfg.align = 8;
      Mlp<float> model(k == Case::widths && tp1 ? std::vector<int>{8, 12, 4}
                                                : std::vector<int>{8, 16, 4});
      try {
        zp::Engine<Threads, float, 3> engine(grid, model, cfg);
      } catch (const zp::Error& e) {
        std::lock_guard lk(m);
        errors.emplace_back(grid.coords().tp, e.what());
      }
    });
    if (k == Case::plain) {
      CHECK(errors.empty());
      continue;
    }
    REQUIRE(errors.size() == 4);
    for (const auto& [tp, e] : errors)
      CHECK_MESSAGE(
          (k == Case::weights_on_dp0
               ? e.find(
                     "differ in their ZeRO++ quantization (this rank: quantized weights block ") !=
                     std::string::npos
           : k == Case::weights_on_rank3
               ? e.find(
                     "differ in their ZeRO++ quantization (this rank: quantized weights block ") !=
                         std::string::npos ||
                     (tp == 0 && e.find("was poisoned") != std::string::npos)
               : e.find("ZeRO++'s quantization on a tensor-parallel grid (tp 2) needs every TP "
                        "rank to quantize the replicated parameters alike") != std::string::npos),
          e);
  }
}

TEST_CASE("a rank whose model lacks initial values is an error naming them on every rank") {
  std::mutex m;
  std::vector<std::string> errors;
  run_threads(3, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    if (comm.rank() == 1) model.layers[0].b.value.rebind(nullptr);
    auto cfg = test_config(2, 1);
    cfg.broadcast_initial_params = false;  // every rank's own values
    try {
      zp::Engine<Threads, float, 1> engine(comm, model, cfg);
    } catch (const zp::Error& e) {
      std::lock_guard lk(m);
      errors.push_back(e.what());
    }
  });
  REQUIRE(errors.size() == 3);
  for (const auto& e : errors)
    CHECK_MESSAGE(
        e.find("parameter 'layer0.bias' has no initial values on rank 1") != std::string::npos, e);
}

namespace {
// Stage's engine refuses a step whose learning rate differs between ranks, or is invalid on one
// rank or on all, on every rank and without waiting for a timeout; with the rate agreed again,
// the next window trains exactly as if the refused ones had never run.
template <int Stage>
void continue_after_a_refused_step() {
  constexpr int gas = 2;
  constexpr int ranks = 3;
  std::atomic<int> named{0};
  run_threads(ranks, [&](Collective<Threads>& comm) {
    Mlp<float> model, clean_model;
    zp::Engine<Threads, float, Stage> engine(comm, model, test_config(2, gas));
    zp::Engine<Threads, float, Stage> clean(comm, clean_model, test_config(2, gas));
    const auto window = [&](auto& e, Mlp<float>& m, std::int64_t first) {
      zp::StepResult r;
      for (int i = 0; i < gas; ++i)
        r = zp::test::micro_step(e, m, first + 2 * (i + gas * comm.rank()), 2);
      return r;
    };
    const float lr = engine.optimizer().lr;
    window(engine, model, 0);
    window(clean, clean_model, 0);
    const auto before = engine.gather_master();
    // This rank's lr in the refused window, and what its error must say.
    const auto refused = [&](float rank_lr, const char* expected) {
      engine.optimizer().lr = rank_lr;
      try {
        window(engine, model, 100);
      } catch (const zp::Error& e) {
        const std::string said = e.what();
        named += said.find(expected) != std::string::npos;
        CHECK(said.find("zp: ", 1) == std::string::npos);  // one category prefix, not two
      }
      CHECK(engine.gather_master() == before);  // nothing was applied
    };
    constexpr const char* differ = "hyper-parameters differ between ranks at optimizer step 2";
    constexpr const char* invalid = "lr must be";
    refused(comm.rank() == 1 ? 2 * lr : lr, differ);  // a schedule evaluated differently
    refused(comm.rank() == 1 ? -lr : lr, comm.rank() == 1 ? invalid : differ);
    refused(std::nanf(""), invalid);
    engine.optimizer().lr = lr;
    CHECK(window(engine, model, 200).applied);
    window(clean, clean_model, 200);
    CHECK(engine.steps() == 2);
    CHECK(engine.gather_master() == clean.gather_master());
    CHECK(engine.gather_params() == clean.gather_params());
  });
  CHECK(named == 3 * ranks);
}

// An engine built on a model whose old engine still lives (`e = std::make_unique<E>(...)`)
// keeps its views when the old one goes, and trains as a first engine does.
template <int Stage>
void replace_engine() {
  run_threads(2, [&](Collective<Threads>& comm) {
    using E = zp::Engine<Threads, float, Stage>;
    Mlp<float> model, first_model;
    auto engine = std::make_unique<E>(comm, model, test_config(2, 1));
    zp::test::micro_step(*engine, model, comm.rank() * 2, 2);
    for (auto& l : model.layers) {  // back to the initial weights, for the new engine to copy
      l.w.value.rebind(l.w0.data());
      l.b.value.rebind(l.b0.data());
    }
    engine = std::make_unique<E>(comm, model, test_config(2, 1));  // the old one goes after
    if constexpr (Stage < 3) CHECK(model.layers[0].w.value.bound());
    zp::test::micro_step(*engine, model, 10 + comm.rank() * 2, 2);
    E first(comm, first_model, test_config(2, 1));
    zp::test::micro_step(first, first_model, 10 + comm.rank() * 2, 2);
    CHECK(engine->gather_params() == first.gather_params());
  });
}
}  // namespace

TEST_CASE(
    "a learning rate that differs between ranks at a step, or is invalid on some, is an error on "
    "every rank, and the next window starts clean") {
  continue_after_a_refused_step<0>();
  continue_after_a_refused_step<1>();
  continue_after_a_refused_step<2>();
  continue_after_a_refused_step<3>();
}

TEST_CASE("an engine replacing one that still lives keeps the model's views and trains the same") {
  replace_engine<0>();
  replace_engine<1>();
  replace_engine<2>();
  replace_engine<3>();
}

// A backward guard that must wait for a scratch bucket's reduction, which a failed rank never
// joins: backward() fails with the abort, naming itself, and the engine refuses to go on.
TEST_CASE("a backward guard waiting on a failed rank's reduction: an error, and the engine stops") {
  std::string error, after;
  const auto body = [&](Collective<Threads>& comm) {
    Mlp<float> model;
    zp::Engine<Threads, float, 2> engine(comm, model, test_config(2, 1));
    if (comm.rank() == 1) throw std::runtime_error("rank 1 stopped");
    forward_all(engine, model, 0);
    try {
      for (int l = model.modules() - 1; l >= 0; --l) {
        auto g = engine.backward(l);
        model.backward(l);
      }
    } catch (const zp::Error& e) {
      error = e.what();
    }
    try {
      engine.step();
    } catch (const zp::Error& e) {
      after = e.what();
    }
  };
  CHECK_THROWS(run_threads(2, body));
  INFO(error);
  INFO(after);
  CHECK(error.find("engine: backward() at optimizer step 1") != std::string::npos);
  CHECK(error.find("rank 1 failed: rank 1 stopped") != std::string::npos);
  CHECK(after.find("unusable since backward(") != std::string::npos);
}

// The scale is set at construction and by restore() (a checkpoint's): each is checked there,
// before any micro-step is spent (a dynamic scale grows only to 2^64).
TEST_CASE("a loss scale that, times the accumulation steps, is past fp32 is an error naming both") {
  const std::initializer_list<std::string> past = {
      "the loss scale 9.99999968", "x gradient_accumulation_steps 4 is past fp32's range"};
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    auto c = test_config(2, 4);
    c.loss_scaler = zp::LossScaler::fixed(1e38f);
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 2> e(comm, model, c); }, past);
    zp::test::expect_invalid(
        [&] { (void)zp::Engine<Threads, float, 2>::estimate_memory(model, 2, c); }, past);
    c.loss_scaler = zp::LossScaler::dynamic();
    zp::Engine<Threads, float, 2> engine(comm, model, c);
    auto progress = engine.progress();
    const auto before = progress.scaler;
    progress.scaler.scale = 1e38f;
    zp::test::expect_invalid([&] { engine.restore(progress); }, past);
    CHECK(engine.progress().scaler == before);  // left as it was
    for (int i = 0; i < 4; ++i) zp::test::micro_step(engine, model, 8 * comm.rank() + 2 * i, 2);
    CHECK(engine.steps() == 1);
  });
}

TEST_CASE(
    "gather_state of a state array the optimizer lacks, and buckets under one element, are "
    "errors naming them") {
  run_threads(1, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    zp::Engine<Threads, float, 1> engine(comm, model, test_config(2, 1));
    zp::test::expect_invalid([&] { (void)engine.gather_state(2); },
                             {"gather_state(2)", "state arrays [0, 2)"});
    zp::test::expect_invalid([&] { (void)engine.gather_state(-1); }, {"gather_state(-1)"});
    CHECK(engine.gather_state(1).size() == engine.layout().used());
    auto c = test_config(2, 1);
    c.bucket_bytes = 3;
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 1> e(comm, model, c); },
                             {"bucket_bytes (3)", "at least one element (4 bytes)"});
  });
}

TEST_CASE("max_grad_norm NaN and invalid optimizer values are rejected at construction") {
  run_threads(1, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    auto c = test_config(2, 1);
    c.max_grad_norm = std::nanf("");
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 1> e(comm, model, c); },
                             {"max_grad_norm is NaN"});
    zp::test::expect_invalid(
        [&] {
          zp::Engine<Threads, float, 1> e(comm, model, test_config(2, 1),
                                          zp::optim::AdamW{.lr = -1});
        },
        {"lr"});
    c = test_config(2, 1);
    c.optimizer_options.threads = 0;
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 1> e(comm, model, c); },
                             {"engine: optimizer_options.threads must be >= 1, got 0"});
    c = test_config(2, 1);
    c.quantized_weights = zp::quant::Format{.block = 0};
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 3> e(comm, model, c); },
                             {"quantize: block size 0 must be in [1, 2^31]"});
  });
  // Settings bad on one rank only: checked before anything is laid out, and agreed on, so the
  // other rank's error names the value too.
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    auto c = test_config(2, 1);
    if (comm.rank() == 1) c.max_grad_norm = std::nanf("");
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 2> e(comm, model, c); },
                             {comm.rank() == 1 ? "engine: max_grad_norm is NaN"
                                               : "rank 1 failed: engine: max_grad_norm is NaN"});
    // An instruction set forced on one rank (one whose CPU lacks it, on a mixed cluster).
    c = test_config(2, 1);
    if (comm.rank() == 1) c.optimizer_options.isa = zp::optim::cpu::Isa(7);
    zp::test::expect_invalid([&] { zp::Engine<Threads, float, 1> e(comm, model, c); },
                             {"optimizer: instruction set Isa(7) is not one of best, portable, "
                              "avx2, avx512 (0 to 3)"});
    // The NVMe settings, the parameters' offload and the gradient types: each was found only
    // as the buffers were allocated, on the bad rank alone.
    const auto bad_on_rank_1 = [&](void (*set)(zp::EngineConfig&), const std::string& what) {
      auto bad = test_config(2, 1);
      if (comm.rank() == 1) set(bad);
      zp::test::expect_invalid([&] { zp::Engine<Threads, float, 2> e(comm, model, bad); },
                               {comm.rank() == 1 ? what : "rank 1 failed: " + what});
    };
    bad_on_rank_1(
        [](zp::EngineConfig& b) {
          b.optimizer_nvme = zp::NvmeOptions{.path = "/nonexistent", .buffer_count = 1};
        },
        "offload to nvme: buffer_count 1 is not in [2, 64]");
    bad_on_rank_1([](zp::EngineConfig& b) { b.offload_param = true; },
                  "engine: parameters offloaded (offload_param: cpu) need ZeRO stage 3");
    bad_on_rank_1([](zp::EngineConfig& b) { b.grad_accum_dtype = zp::DType::bf16; },
                  "engine: grad_accum_dtype must be f32 or the model's f32, got bf16");
  });
}

// Scratch slots past one a segment would hold nothing: a huge bucket_slots keeps the layout's
// segments + 1 (its bytes, counted as they are allocated, never wrap).
TEST_CASE("bucket_slots past the segments keeps one slot a segment, plus one") {
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    auto c = test_config(2, 1);
    c.bucket_slots = std::size_t(1) << 61;
    zp::Engine<Threads, float, 2> engine(comm, model, c);
    zp::test::micro_step(engine, model, 2 * comm.rank(), 2);
    const zp::Layout& L = engine.layout();
    const std::size_t slots = std::size_t(L.segment_count()) + 1;
    CHECK(engine.memory().buckets == slots * L.largest_segment() * sizeof(float));
  });
}

TEST_CASE("batch products that overflow are errors, not wrapped sizes") {
  CHECK_THROWS_WITH_AS(zp::resolve_batch({.micro_batch_per_rank = std::int64_t(1) << 40,
                                          .gradient_accumulation_steps = std::int64_t(1) << 30},
                                         64),
                       doctest::Contains("overflows a 64-bit integer"), zp::Error);
}

TEST_CASE(
    "step timers: each phase holds at least the time spent in it, and the hidden share is a "
    "fraction") {
  using namespace std::chrono_literals;
  constexpr int gas = 2;
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> m;
    zp::Engine<Threads, float, 3> e(comm, m, test_config(1, gas));
    for (int t = 0; t < 2; ++t) {
      zp::StepResult r;
      for (int i = 0; i < gas; ++i) {
        std::vector<int> labels;
        m.load(comm.rank() * 2, 2, labels);
        for (int l = 0; l < m.modules(); ++l) {
          auto g = e.forward(l);
          m.forward(l);
          std::this_thread::sleep_for(2ms);
        }
        m.loss(labels, e.loss_scale());
        std::this_thread::sleep_for(5ms);  // outside every guard: untracked
        for (int l = m.modules() - 1; l >= 0; --l) {
          auto g = e.backward(l);
          m.backward(l);
          std::this_thread::sleep_for(3ms);
        }
        r = e.step();
      }
      const zp::StepTimes& s = r.times;
      INFO(s.describe());
      const double mods = m.modules();
      CHECK(s.forward >= gas * mods * 2e-3);
      CHECK(s.backward >= gas * mods * 3e-3);
      CHECK(s.untracked() >= gas * 5e-3);
      for (double x : {s.gather_wait, s.reduce_wait, s.statistics, s.optimizer, s.gather,
                       s.reduce_span, s.reduce_exposed})
        CHECK(x >= 0);
      CHECK(s.reduce_exposed <= s.reduce_span);
      CHECK(s.total >= s.forward + s.backward + gas * 5e-3);
      CHECK((s.hidden() >= 0 && s.hidden() <= 1));
      CHECK(s.json_fields().find("\"hidden\":") != std::string::npos);
    }
  });
}

namespace {

// A model whose gradient does not depend on its weights: parameter i of module m receives, on
// every micro-step, the sample's value x(m, i), rounded to T as a 16-bit model computes it. So
// the averaged gradient of a step has an exact float64 reference, and with zero initial weights
// one SGD step (lr 1) leaves master = -(that gradient, as the optimizer read it).
template <class T>
struct Probe {
  static constexpr int modules = 2;
  static constexpr std::size_t size = 1000;
  std::vector<T> init = std::vector<T>(size, T(0.0f));
  zp::Param<T> p[modules];
  std::uint64_t seed;
  explicit Probe(std::uint64_t s) : seed(s) {
    for (auto& q : p) q = zp::Param<T>(size), q.value.rebind(init.data());
  }
  template <class V>
  friend void for_each_parameter(Probe& m, V&& visit) {
    for (int i = 0; i < modules; ++i) visit("probe" + std::to_string(i), i, m.p[i]);
  }
  static float x(std::uint64_t seed, std::int64_t sample, int m, std::size_t i) {
    // Values of several magnitudes, so that sums of 16-bit values do not stay exact in 16 bits.
    const float u = zp::test::hash_uniform(seed + std::uint64_t(sample) * 7 + std::uint64_t(m), i);
    return u * std::ldexp(1.0f, int(i % 7) - 3);
  }
  void backward(int m, std::int64_t sample) {
    for (std::size_t i = 0; i < size; ++i)
      p[m].grad[i] = T(float(p[m].grad[i]) + float(T(x(seed, sample, m, i))));
  }
};

// How a probe run's gradients travel: their precision settings and, beside them, hybrid
// sharding and qgZ.
struct ProbeSetup {
  std::optional<zp::DType> accum, comm;
  int ranks = 2;
  int shard_group_size = 0;
  std::optional<zp::quant::Format> qgz;
  int ranks_per_node = 0;  // qgZ's nodes (0: one, with the threads backend's layout)
};

// A probe run of 8 micro-steps per step: the averaged gradient its SGD step read, per element,
// and two references in float64: the mean of the bf16 terms (`mean`), and the mean over ranks of
// each rank's own bf16 sum of its terms (`rank_sums`, what a rank that accumulates in bf16
// before its reduction holds), each with the mean magnitude of the terms (`scale`).
struct ProbeRun {
  std::vector<double> got, mean, rank_sums, scale;
  double peak = 0;  // the largest |term|
  // Max |got - ref| relative to the terms' mean magnitude (a mean near zero says nothing about
  // the rounding), or with `of_peak` to the largest term (a quantization's bound).
  double error(const std::vector<double>& ref, bool of_peak = false) const {
    double worst = 0;
    for (std::size_t k = 0; k < got.size(); ++k) {
      const double e = std::fabs(got[k] - ref[k]) / (of_peak ? peak : scale[k]);
      if (!(e <= worst)) worst = e;  // a NaN (or 0/0) is the worst
    }
    return worst;
  }
};

template <int Stage>
ProbeRun probe_run(const ProbeSetup& s) {
  constexpr int gas = 8;
  using P = Probe<zp::bf16>;
  const int ranks = s.ranks;
  const std::uint64_t seed = zp::test::mlp_seed();
  std::vector<float> master;
  run_threads(ranks, [&](Collective<Threads>& c) {
    P model(seed);
    auto cfg = test_config(1, gas);
    cfg.grad_accum_dtype = s.accum;
    cfg.communication_dtype = s.comm;
    cfg.shard_group_size = s.shard_group_size;
    cfg.quantized_gradients = s.qgz;
    cfg.ranks_per_node = s.ranks_per_node;
    zp::Engine<Threads, zp::bf16, Stage, zp::optim::Sgd> e(c, model, cfg,
                                                           zp::optim::Sgd{.lr = 1.0f});
    for (int i = 0; i < gas; ++i) {
      for (int m = P::modules - 1; m >= 0; --m) {
        auto g = e.backward(m);
        model.backward(m, std::int64_t(i) * ranks + c.rank());
      }
      e.step();
    }
    auto got = e.gather_master();
    if (c.rank() == 0) master = std::move(got);
  });
  ProbeRun run;
  for (int m = 0; m < P::modules; ++m)
    for (std::size_t i = 0; i < P::size; ++i) {
      double mean = 0, rank_sums = 0, scale = 0;
      for (int r = 0; r < ranks; ++r) {
        float own = 0;  // as P::backward accumulates: in bf16, term by term
        for (int step = 0; step < gas; ++step) {
          const float t = float(zp::bf16(P::x(seed, std::int64_t(step) * ranks + r, m, i)));
          own = float(zp::bf16(own + t));
          mean += t;
          scale += std::fabs(t);
          run.peak = std::max(run.peak, double(std::fabs(t)));
        }
        rank_sums += own;
      }
      run.got.push_back(-double(master[std::size_t(m) * P::size + i]));
      run.mean.push_back(mean / (ranks * gas));
      run.rank_sums.push_back(rank_sums / (ranks * gas));
      run.scale.push_back(scale / (ranks * gas));
    }
  return run;
}

template <int Stage>
double probe_error(std::optional<zp::DType> accum, std::optional<zp::DType> comm) {
  const ProbeRun run = probe_run<Stage>({.accum = accum, .comm = comm});
  return run.error(run.mean);
}

template <int Stage>
void check_fp32_accumulation() {
  CAPTURE(Stage);
  const double bf16 = probe_error<Stage>(zp::DType::bf16, std::nullopt);
  const double f32 = probe_error<Stage>(zp::DType::f32, zp::DType::f32);
  const double f32_bf16_comm = probe_error<Stage>(zp::DType::f32, std::nullopt);
  MESSAGE("stage ", Stage,
          ": max error of the averaged gradient (relative to its terms), 8 micro-steps x 2 ranks: "
          "bf16 accumulation ",
          bf16, ", fp32 accumulation with bf16 reduction ", f32_bf16_comm,
          ", fp32 accumulation and reduction ", f32);
  CHECK(bf16 > 1e-3);  // bf16 rounds every partial sum: several bits lost
  CHECK(f32 <= 2e-7);  // fp32 sums of bf16 values, one fp32 rounding of the mean: fp32 rounding
  // Two roundings to bf16 (unit roundoff 2^-8): each rank's fp32 sum before the reduction, the
  // mean after it; each costs at most 2^-8 of the terms' magnitude.
  CHECK(f32_bf16_comm <= 2.0 / 256);

  // bf16 accumulation with an fp32 reduction.
  const ProbeRun run = probe_run<Stage>({.accum = zp::DType::bf16, .comm = zp::DType::f32});
  MESSAGE("stage ", Stage, ", bf16 accumulation with fp32 reduction: max error ",
          run.error(run.mean), " against the mean, ", run.error(run.rank_sums),
          " against the mean of the ranks' bf16 sums");
  if (Stage < 2) {
    // Stages 0 and 1 reduce each rank's bf16 sum once, in fp32, and the optimizer reads that:
    // the mean of the ranks' own bf16 sums, to fp32 rounding.
    CHECK(run.error(run.rank_sums) <= 2e-7);
  } else {
    // Stages 2 and 3 reduce every micro-step in fp32 and sum the 8 means in bf16: at most 7
    // roundings of partial sums no larger than the sum of the terms' magnitudes (first-order
    // bound 7 x 2^-8), and the result's own rounding.
    CHECK(run.error(run.mean) <= 8.0 / 256);
  }
}

}  // namespace

TEST_CASE(
    "fp32 gradient accumulation: a bf16 model's averaged gradient matches float64 to fp32 "
    "rounding") {
  check_fp32_accumulation<0>();
  check_fp32_accumulation<1>();
  check_fp32_accumulation<2>();
  check_fp32_accumulation<3>();
}

// The gradient paths the case above leaves out: hybrid sharding's average over the replicas
// with an fp32 reduction (stage 1) and with fp32 accumulation (stages 2 and 3), and qgZ's
// reduction into fp32.
TEST_CASE("hybrid sharding and qgZ keep the fp32 gradient precision settings") {
  using zp::DType;
  const ProbeSetup hybrid{.ranks = 4, .shard_group_size = 2};
  auto with = [](ProbeSetup s, std::optional<DType> accum, std::optional<DType> comm) {
    s.accum = accum, s.comm = comm;
    return s;
  };
  // Stage 1: each rank's bf16 sum, reduced once in fp32 over its group and its replicas.
  const ProbeRun one = probe_run<1>(with(hybrid, DType::bf16, DType::f32));
  CHECK(one.error(one.rank_sums) <= 2e-7);
  const ProbeRun two = probe_run<2>(with(hybrid, DType::f32, DType::f32));
  const ProbeRun three = probe_run<3>(with(hybrid, DType::f32, DType::f32));
  MESSAGE("hybrid 2 x 2, fp32 accumulation and reduction: stage 2 ", two.error(two.mean),
          ", stage 3 ", three.error(three.mean));
  CHECK(two.error(two.mean) <= 4e-7);  // fp32 roundings of sums of 4 ranks' terms, then 8 steps'
  CHECK(three.error(three.mean) <= 4e-7);

  // qgZ, reduced in fp32: int8 blocks, each quantization off by at most half a step of its
  // block's largest value (peak / 254); a rank's codes, then its piece's mean requantized for
  // the second hop: at most 2 x peak / 254 for every step's mean, so for their mean.
  for (int ranks_per_node : {0, 1}) {
    CAPTURE(ranks_per_node);
    ProbeSetup q = with({}, DType::f32, DType::f32);
    q.qgz = zp::zero_quantized_gradients;
    q.ranks_per_node = ranks_per_node;
    const ProbeRun q2 = probe_run<2>(q);
    const ProbeRun q3 = probe_run<3>(q);
    const double worst = std::max(q2.error(q2.mean, true), q3.error(q3.mean, true));
    MESSAGE("qgZ reduced in fp32: max error ", worst, " of the largest term");
    CHECK(worst <= 2.0 / 254);
  }
}

TEST_CASE(
    "gradient precision settings other than fp32 or the model's type are errors naming both") {
  run_threads(1, [&](Collective<Threads>& c) {
    Mlp<zp::bf16> m;
    auto cfg = test_config(1, 2);
    cfg.grad_accum_dtype = zp::DType::f16;
    zp::test::expect_invalid([&] { zp::Engine<Threads, zp::bf16, 2> e(c, m, cfg); },
                             {"grad_accum_dtype", "bf16", "f16"});
    cfg.grad_accum_dtype.reset();
    cfg.communication_dtype = zp::DType::f64;
    zp::test::expect_invalid([&] { zp::Engine<Threads, zp::bf16, 2> e(c, m, cfg); },
                             {"communication_dtype", "f64"});
  });
}

TEST_CASE("the memory check finds the first group of ranks that share a limit and exceed it") {
  using Room = zp::detail::Room;
  using Limit = zp::detail::Limit;
  const std::uint64_t seed = zp::test::run_seed("engine.test host memory");
  int short_groups = 0, by_limit[3] = {};
  for (int trial = 0; trial < 600; ++trial) {
    const auto x = [&](std::uint64_t k) {
      return zp::test::mix(seed + std::uint64_t(trial) * 128 + k);
    };
    const std::size_t ranks = 1 + x(0) % 9;
    std::vector<std::int64_t> t(ranks * Room::fields);
    for (std::size_t r = 0; r < ranks; ++r) {
      std::int64_t* row = &t[r * Room::fields];
      row[Room::cgroup_id] = std::int64_t(x(r + 1) % 4) * 1000003;  // 0: none
      row[Room::machine_id] = std::int64_t(1 + x(r + 11) % 3) * 7919;
      row[Room::device_id] = std::int64_t(x(r + 51) % 3) * 104729;  // 0: none
      row[Room::cgroup_room] = std::int64_t(x(r + 21) % 6000);
      row[Room::machine_room] = std::int64_t(x(r + 31) % 6600);
      row[Room::device_room] = std::int64_t(x(r + 61) % 3600);
      row[Room::host_need] = std::int64_t(x(r + 41) % 400);
      row[Room::device_need] = std::int64_t(x(r + 71) % 400);
    }
    // The reference: each kind's groups keyed by identity, in the order of their first rank.
    std::optional<zp::detail::ShortOfRoom> want;
    for (const Limit limit : {Limit::cgroup, Limit::machine, Limit::device}) {
      const std::size_t id = limit == Limit::cgroup    ? Room::cgroup_id
                             : limit == Limit::machine ? Room::machine_id
                                                       : Room::device_id;
      std::map<std::int64_t, zp::detail::ShortOfRoom> groups;
      std::vector<std::int64_t> order;
      for (std::size_t r = 0; r < ranks; ++r) {
        const std::int64_t g = t[r * Room::fields + id];
        if (g == 0) continue;
        if (!groups.count(g)) order.push_back(g);
        auto& s =
            groups.try_emplace(g, zp::detail::ShortOfRoom{limit, {}, 0, INT64_MAX}).first->second;
        s.ranks.push_back(int(r));
        s.need +=
            t[r * Room::fields + (limit == Limit::device ? Room::device_need : Room::host_need)];
        s.room = std::min(s.room, t[r * Room::fields + id + 1]);
      }
      for (const std::int64_t g : order)
        if (!want && groups[g].need > groups[g].room) want = groups[g];
    }
    const auto got = zp::detail::short_of_room(t);
    CAPTURE(trial);
    REQUIRE(got.has_value() == want.has_value());
    if (!got) continue;
    ++short_groups;
    ++by_limit[int(got->limit)];
    CHECK(got->limit == want->limit);
    CHECK(got->ranks == want->ranks);
    CHECK(got->need == want->need);
    CHECK(got->room == want->room);
  }
  CHECK(short_groups < 450);  // the draws exercise every outcome
  for (const int n : by_limit) CHECK(n > 15);
}

namespace {
// Engine::estimate_memory, taken before any communicator exists, against memory_plan() of an
// engine built with the same model and config (which tests/memory_check.hpp checks against the
// allocator): every field of both spaces, for random settings.
template <int Stage>
void check_estimate(std::uint64_t seed) {
  using E = zp::Engine<Threads, zp::bf16, Stage>;
  for (int trial = 0; trial < 12; ++trial) {
    const std::uint64_t x = zp::test::mix(seed + std::uint64_t(Stage * 1000 + trial));
    const int ranks = x % 2 ? 4 : 2;
    EngineConfig cfg = test_config(2, 1 + int(x >> 1 & 1));
    cfg.bucket_bytes = 512u << (x >> 2 & 3);
    cfg.bucket_slots = 1 + (x >> 4 & 3);
    cfg.offload_optimizer = x >> 6 & 1;
    if (x >> 7 & 1) cfg.grad_accum_dtype = zp::DType::f32;
    if (Stage >= 1 && (x >> 8 & 1)) cfg.shard_group_size = 2;
    if (Stage >= 2 && (x >> 9 & 1)) cfg.quantized_gradients = zp::zero_quantized_gradients;
    if (Stage == 3) {
      cfg.persist_threshold = (x >> 10) % 600;
      cfg.hpz_partition_size = x >> 20 & 1 ? 2 : 1;
      cfg.offload_param = x >> 21 & 1;
    }
    CAPTURE(trial);
    CAPTURE(ranks);
    Mlp<zp::bf16> reference;
    const zp::MemoryPlan want = E::estimate_memory(reference, ranks, cfg);
    run_threads(ranks, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      E engine(comm, model, cfg);
      const zp::MemoryPlan got = engine.memory_plan();
      for (const auto& [a, b] : {std::pair{&want.host, &got.host}, {&want.device, &got.device}}) {
        CHECK(a->params == b->params);
        CHECK(a->grads == b->grads);
        CHECK(a->master == b->master);
        CHECK(a->optimizer_state == b->optimizer_state);
        CHECK(a->buckets == b->buckets);
        CHECK(a->gathered == b->gathered);
        CHECK(a->secondary == b->secondary);
        CHECK(a->offloaded == b->offloaded);
        CHECK(a->swap_buffers == b->swap_buffers);
      }
      CHECK(got.host.model_states() > 0);
    });
  }
}
}  // namespace

TEST_CASE("estimate_memory is the plan an engine of that model and config checks") {
  const std::uint64_t seed = zp::test::run_seed("engine.test estimate");
  check_estimate<0>(seed);
  check_estimate<1>(seed);
  check_estimate<2>(seed);
  check_estimate<3>(seed);
  Mlp<zp::bf16> model;
  zp::test::expect_invalid(
      [&] { zp::Engine<Threads, zp::bf16, 3>::estimate_memory(model, 0, test_config(2, 1)); },
      {"estimate_memory for 0 ranks and tp 1; expected at least 1 of each"});
  zp::test::expect_invalid(
      [&] { zp::Engine<Threads, zp::bf16, 3>::estimate_memory(model, 2, test_config(2, 1), 0); },
      {"estimate_memory for 2 ranks and tp 0; expected at least 1 of each"});
  // Settings an engine would refuse are refused here too, with the engine's messages.
  const auto refused = [&]<int Stage>(std::integral_constant<int, Stage>, int ranks,
                                      void (*set)(zp::EngineConfig&),
                                      std::initializer_list<std::string> what) {
    auto c = test_config(2, 1);
    set(c);
    zp::test::expect_invalid(
        [&] { zp::Engine<Threads, zp::bf16, Stage>::estimate_memory(model, ranks, c); }, what);
  };
  constexpr std::integral_constant<int, 2> two{};
  constexpr std::integral_constant<int, 3> three{};
  refused(three, 4, [](zp::EngineConfig& c) { c.shard_group_size = 3; },
          {"shard_group_size 3 does not divide the 4 data-parallel ranks"});
  refused(three, 4, [](zp::EngineConfig& c) { c.hpz_partition_size = 3; },
          {"hpz_partition_size 3 does not divide the 4 data-parallel ranks"});
  refused(three, 4,
          [](zp::EngineConfig& c) {
            c.shard_group_size = 2;
            c.hpz_partition_size = 4;
          },
          {"hpz_partition_size 4 does not divide the 2 ranks of the shard group"});
  refused(three, 4,
          [](zp::EngineConfig& c) {
            c.quantized_gradients = zp::zero_quantized_gradients;
            c.ranks_per_node = 8;
          },
          {"ranks_per_node 8 does not divide the 4 data-parallel ranks"});
  refused(two, 4, [](zp::EngineConfig& c) { c.quantized_weights = zp::zero_quantized_weights; },
          {"quantized weight gathers (zero_quantized_weights) need ZeRO stage 3", "got stage 2"});
  refused(two, 4, [](zp::EngineConfig& c) { c.param_nvme = zp::NvmeOptions{.path = "/nvme"}; },
          {"parameters offloaded (offload_param: nvme) need ZeRO stage 3", "got stage 2"});
  refused(three, 4,
          [](zp::EngineConfig& c) {
            c.optimizer_nvme = zp::NvmeOptions{.path = "/nvme", .block_size = 1000};
          },
          {"offload to nvme: block_size 1000 is not a multiple of 4096"});
  refused(three, 4, [](zp::EngineConfig& c) { c.communication_dtype = zp::DType::f16; },
          {"communication_dtype must be f32 or the model's bf16, got f16"});
}

// zp.test.engine.memory_cgroup runs this in a memory cgroup of ZP_TEST_MEMORY_LIMIT bytes without
// swap (tests/in_cgroup.sh). Two ranks whose model states (stage 0, bf16, AdamW: 16 bytes an
// element) need 0.7 of the limit each are refused on both, naming the cgroup, before either
// allocates them; without the check the kernel kills the process as they are zeroed. States of
// 0.1 of the limit each are built. Skipped in the program's own run: only there (--no-skip).
TEST_CASE("model states past a memory cgroup's room are refused on every rank, naming it" *
          doctest::skip()) {
  const char* limit = std::getenv("ZP_TEST_MEMORY_LIMIT");
  REQUIRE_MESSAGE(limit, "not in a memory cgroup (zp.test.engine.memory_cgroup runs this in one)");
  const std::size_t bytes = std::strtoull(limit, nullptr, 10);
  REQUIRE(bytes > 0);
  const auto build = [](Collective<Threads>& comm, std::size_t n) {
    zp::test::Huge model(n);
    auto cfg = test_config(2, 1);
    cfg.initializer = zp::test::huge_values;
    zp::Engine<Threads, zp::bf16, 0> engine(comm, model, cfg);
    CHECK(engine.memory().model_states() == 16 * engine.partition().layout().total());
  };
  run_threads(2, [&](Collective<Threads>& comm) {
    const std::int64_t before = zp::memory_use<zp::MemorySpace::host>().current;
    zp::test::expect_error(
        zp::Errc::out_of_memory, [&] { build(comm, bytes * 7 / 10 / 16); },
        {"not enough host memory: ranks 0, 1 need ", "left by the memory cgroup /", "this rank's ",
         "optimizer state ", "offload_optimizer: nvme"});
    CHECK(zp::memory_use<zp::MemorySpace::host>().current == before);
    build(comm, bytes / 10 / 16);
  });
}
