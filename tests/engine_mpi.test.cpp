// The engine on the mpi backend (ctest runs it at 2 and 4 processes): every stage agrees with a
// single-rank run of the same global batch (computed in each process on the threads backend)
// and with each other, to rounding (the bitwise guarantees are pinned by the threads tests and,
// for the mpi backend's reductions, tests/backend/mpi_node.test.cpp).
#include "zp/backend/mpi.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

#include "zp/backend/threads.hpp"
#include "zp/engine.hpp"
#include "zp/grid.hpp"
#include "zp/quantized_collectives.hpp"
#if ZP_TEST_IO
#include "zp/checkpoint.hpp"
#endif
#include "expect_error.hpp"
#include "zero_mlp.hpp"

using zp::Collective;
using zp::backend::Mpi;
using zp::test::Mlp;

namespace {

zp::EngineConfig config(int micro_batch, int gas) {
  zp::EngineConfig c;
  c.batch = {.micro_batch_per_rank = micro_batch, .gradient_accumulation_steps = gas};
  c.bucket_bytes = 4096;
  c.first_bucket_bytes = 512;
  c.align = 4;
  return c;
}

// The master weights after training (with `also`: the parameters and AdamW's state appended).
template <class T, int Stage, class B>
std::vector<float> train(Collective<B>& comm, int steps, int gas, int micro_batch,
                         const zp::EngineConfig* cfg = nullptr, bool also = false) {
  const int n = comm.size(), r = comm.rank();
  Mlp<T> model;
  zp::Engine<B, T, Stage> engine(
      comm, model, cfg ? *cfg : config(micro_batch, gas),
      zp::optim::AdamW{.lr = 1e-2f, .eps = 1e-4f});  // eps: see engine.test.cpp
  for (int t = 0; t < steps; ++t)
    for (int i = 0; i < gas; ++i)
      zp::test::micro_step(engine, model, (std::int64_t(t * gas + i) * n + r) * micro_batch,
                           micro_batch);
  std::vector<float> out = engine.gather_master();
  if (also) {
    for (T x : engine.gather_params()) out.push_back(float(x));
    for (int k = 0; k < 2; ++k)
      for (float x : engine.gather_state(k)) out.push_back(x);
  }
  return out;
}

template <class T>
std::vector<float> single_rank(int ranks, int steps, int gas, int micro_batch) {
  std::vector<float> out;
  zp::backend::run_threads(1, [&](Collective<zp::backend::Threads>& comm) {
    out = train<T, 0>(comm, steps, gas, micro_batch * ranks);
  });
  return out;
}

// Same steps and bounds as the threads tests (engine.test.cpp, check_close): few steps, so a
// rounding difference cannot yet have pushed a unit across a kink.
constexpr int close_steps = 3;
template <class T>
void check_close(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double mx = 0, mean = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    mx = std::max(mx, d);
    mean += d / double(a.size());
  }
  if constexpr (std::is_same_v<T, float>) {
    CHECK(mx <= 1e-5);
    CHECK(mean <= 1e-7);
  } else {
    CHECK(mx <= 2 * close_steps * 1e-2);
    CHECK(mean <= 2e-3);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("on mpi every stage agrees with a single-rank run on the same global batch", T,
                   float, zp::bf16) {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  for (int gas : {1, 2}) {
    CAPTURE(gas);
    const auto one = single_rank<T>(comm.size(), close_steps, gas, 3);
    const auto s0 = train<T, 0>(comm, close_steps, gas, 3);
    const auto s1 = train<T, 1>(comm, close_steps, gas, 3);
    const auto s2 = train<T, 2>(comm, close_steps, gas, 3);
    const auto s3 = train<T, 3>(comm, close_steps, gas, 3);
    check_close<T>(one, s0);
    check_close<T>(one, s1);
    check_close<T>(one, s2);
    check_close<T>(one, s3);
    check_close<T>(s0, s3);
  }
}

// ZeRO++'s quantized weight gathers on MPI: the records travel as MPI's 32-bit integers; the
// training equals the threads backend's with the same ranks (to the reduction order's rounding).
TEST_CASE_TEMPLATE("on mpi quantized weight gathers train as on the threads backend", T, float,
                   zp::bf16) {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  zp::EngineConfig cfg = config(3, 1);
  cfg.quantized_weights = zp::quant::Format{.bits = zp::quant::Bits::int8, .block = 8};
  std::vector<float> threads;
  zp::backend::run_threads(comm.size(), [&](Collective<zp::backend::Threads>& c) {
    auto out = train<T, 3>(c, close_steps, 1, 3, &cfg, true);
    if (c.rank() == 0) threads = std::move(out);
  });
  check_close<T>(threads, train<T, 3>(comm, close_steps, 1, 3, &cfg, true));
}

// qgZ's two-hop reduce_scatter on MPI (nodes of 2 processes): the threads backend's bits, since
// every addition runs in a fixed order on one rank.
TEST_CASE("on mpi qgZ's quantized reduce_scatter gives the threads backend's bits") {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  const int n = comm.size(), h = 2;
  const zp::quant::Format f{.bits = zp::quant::Bits::int4, .block = 16};
  const std::size_t piece = 75;
  const std::uint64_t drawn = zp::test::fresh_seed();
  std::int64_t seed = std::int64_t(drawn >> 1);
  comm.broadcast(std::span<std::int64_t>(&seed, 1), 0);
  zp::test::redrawn(drawn, std::uint64_t(seed) << 1);  // rank 0's draw, but for its last bit
  auto input = [&](int r) {
    std::mt19937_64 rng(std::uint64_t(seed) + std::uint64_t(r));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<zp::bf16> x(std::size_t(n) * piece);
    for (auto& v : x) v = zp::bf16(normal(rng));
    return x;
  };
  auto sum = [&](auto& c) {
    auto node = c.split(c.rank() / h, c.rank() % h);
    auto peers = c.split(c.rank() % h, c.rank() / h);
    const auto x = input(c.rank());
    std::vector<float> out(piece, std::numeric_limits<float>::quiet_NaN());  // unwritten: NaN
    zp::quant::reduce_scatter(node, peers, std::span<const zp::bf16>(x), std::span(out), f);
    return out;
  };
  std::vector<float> threads;
  zp::backend::run_threads(n, [&](Collective<zp::backend::Threads>& c) {
    auto out = sum(c);
    if (c.rank() == comm.rank()) threads = std::move(out);
  });
  const auto mpi = sum(comm);
  CHECK(std::memcmp(threads.data(), mpi.data(), piece * sizeof(float)) == 0);
  CHECK(std::ranges::all_of(mpi, [](float v) { return std::isfinite(v); }));
}

// qgZ in the engine on MPI (nodes of 2 processes): bitwise the threads backend's training, the
// quantized reduction's sums running in a fixed order on each rank (no clipping: the norm's
// all_reduce, in MPI's order, is only reported).
TEST_CASE_TEMPLATE("on mpi quantized gradients (qgZ) train bitwise as on the threads backend", T,
                   float, zp::bf16) {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  zp::EngineConfig cfg = config(2, 2);
  cfg.quantized_gradients = zp::quant::Format{.bits = zp::quant::Bits::int4, .block = 16};
  cfg.ranks_per_node = 2;
  auto both = [&]<int Stage>(std::integral_constant<int, Stage>) {
    CAPTURE(Stage);
    std::vector<float> threads;
    zp::backend::run_threads(comm.size(), [&](Collective<zp::backend::Threads>& c) {
      auto out = train<T, Stage>(c, close_steps, 2, 2, &cfg, true);
      if (c.rank() == 0) threads = std::move(out);
    });
    const auto mpi = train<T, Stage>(comm, close_steps, 2, 2, &cfg, true);
    REQUIRE(mpi.size() == threads.size());
    CHECK(std::memcmp(mpi.data(), threads.data(), mpi.size() * sizeof(float)) == 0);
  };
  both(std::integral_constant<int, 2>{});
  both(std::integral_constant<int, 3>{});
}

// qgZ's nodes, not given, are the mpi backend's node layout (one machine, or ZP_RANKS_PER_NODE:
// ctest runs this file again as 2 nodes x 2).
TEST_CASE("on mpi qgZ's nodes default to the backend's node layout") {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  zp::EngineConfig cfg = config(2, 2);
  cfg.quantized_gradients = zp::zero_quantized_gradients;
  Mlp<float> model;
  zp::Engine<Mpi, float, 2> engine(comm, model, cfg, zp::optim::AdamW{});
  const auto layout = comm.backend().node_layout();
  REQUIRE(engine.qgz_node_group() != nullptr);
  CHECK(engine.qgz_node_group()->size() == layout.per_node);
  CHECK(engine.qgz_cross_group()->size() == layout.nodes);
  if (const char* e = std::getenv("ZP_RANKS_PER_NODE")) CHECK(layout.per_node == std::atoi(e));
  // Under hybrid sharding, as a shard group of 2 sees them: inside one node of 4, one node of 2.
  cfg.shard_group_size = 2;
  Mlp<float> hybrid_model;
  zp::Engine<Mpi, float, 2> hybrid(comm, hybrid_model, cfg, zp::optim::AdamW{});
  const int per_group = std::gcd(layout.per_node, 2);
  REQUIRE(hybrid.qgz_node_group() != nullptr);
  CHECK(hybrid.qgz_node_group()->size() == per_group);
  CHECK(hybrid.qgz_cross_group()->size() == 2 / per_group);
}

// ZeRO++'s secondary partition on MPI (2 processes a node; at 2 processes the node is the world):
// the node's gathers on MPI's split communicator, bitwise the training without it.
TEST_CASE_TEMPLATE("on mpi a secondary partition (hpZ) trains bitwise as without it", T, float,
                   zp::bf16) {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  zp::EngineConfig cfg = config(2, 2);
  const auto plain = train<T, 3>(comm, close_steps, 2, 2, &cfg, true);
  cfg.hpz_partition_size = 2;
  const auto hpz = train<T, 3>(comm, close_steps, 2, 2, &cfg, true);
  REQUIRE(plain.size() == hpz.size());
  CHECK(std::memcmp(plain.data(), hpz.data(), plain.size() * sizeof(float)) == 0);
}

// Hybrid sharding on MPI (shard groups of 2 processes; at 2 processes the group is the world):
// ZeRO inside each group and the replicas' all_reduce, on MPI's split communicators, train as
// the threads backend does with as many ranks (to the reductions' rounding).
TEST_CASE_TEMPLATE("on mpi hybrid sharding trains as on the threads backend", T, float, zp::bf16) {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  zp::EngineConfig cfg = config(2, 2);
  cfg.shard_group_size = 2;
  std::vector<float> threads1, threads3;
  zp::backend::run_threads(comm.size(), [&](Collective<zp::backend::Threads>& c) {
    auto one = train<T, 1>(c, close_steps, 2, 2, &cfg, true);
    auto three = train<T, 3>(c, close_steps, 2, 2, &cfg, true);
    if (c.rank() == 0) threads1 = std::move(one), threads3 = std::move(three);
  });
  check_close<T>(threads1, train<T, 1>(comm, close_steps, 2, 2, &cfg, true));
  check_close<T>(threads3, train<T, 3>(comm, close_steps, 2, 2, &cfg, true));
}

#if defined(ZP_WITH_AIO)
// ZeRO-Infinity on MPI: each process's optimizer state (at stage 3 its parameter shard too) in
// its own swap files, bitwise the same training as in host memory.
TEST_CASE_TEMPLATE("on mpi the optimizer state on NVMe trains bitwise as in memory", T, float,
                   zp::bf16) {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  const auto dir =
      std::filesystem::temp_directory_path() / ("zp-mpi-nvme-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  zp::EngineConfig cfg = config(2, 2);
  cfg.max_grad_norm = 0.5f;
  cfg.offload_optimizer = true;
  auto both = [&]<int Stage>(std::integral_constant<int, Stage>) {
    CAPTURE(Stage);
    cfg.optimizer_nvme.reset();
    const auto memory = train<T, Stage>(comm, 4, 2, 2, &cfg, true);
    cfg.optimizer_nvme = zp::NvmeOptions{
        .path = dir, .pipeline_read = true, .pipeline_write = true, .sub_group_size = 1024};
    if (Stage == 3) cfg.param_nvme = zp::NvmeOptions{.path = dir};  // the parameters too
    const auto nvme = train<T, Stage>(comm, 4, 2, 2, &cfg, true);
    cfg.param_nvme.reset();
    REQUIRE(memory.size() == nvme.size());
    CHECK(std::memcmp(memory.data(), nvme.data(), memory.size() * sizeof(float)) == 0);
  };
  both(std::integral_constant<int, 0>{});
  both(std::integral_constant<int, 1>{});
  both(std::integral_constant<int, 2>{});
  both(std::integral_constant<int, 3>{});
  CHECK(std::filesystem::is_empty(dir));
  std::filesystem::remove_all(dir);
}
#endif

// The teardown rules on MPI (its Work waits in its destructor; the buckets complete before
// their slots go): an engine left between backward and step, and an exception inside a
// backward guard caught outside the engine, on every rank, for every stage, repeatedly.
template <int Stage>
void teardown(Collective<Mpi>& comm) {
  const int r = comm.rank();
  for (int rep = 0; rep < 5; ++rep) {
    Mlp<zp::bf16> model;
    {
      zp::Engine<Mpi, zp::bf16, Stage> engine(comm, model, config(2, 1));
      zp::test::micro_step(engine, model, r * 2, 2);
      std::vector<int> labels;
      model.load(8 + r * 2, 2, labels);
      for (int l = 0; l < model.modules(); ++l) {
        auto g = engine.forward(l);
        model.forward(l);
      }
      model.loss(labels, 1.0f);
      try {
        for (int l = model.modules() - 1; l >= 0; --l) {
          auto g = engine.backward(l);
          model.backward(l);
          if (rep % 2 == 1 && l == 1) throw std::runtime_error("stop");
        }
      } catch (const std::runtime_error&) {
      }
    }  // reductions of the launched buckets are in flight here
    CHECK(!model.layers[0].w.value.bound());
    std::int64_t x = 1;
    comm.all_reduce(std::span<std::int64_t>(&x, 1));  // the communicator is still in step
    CHECK(x == comm.size());
  }
}

TEST_CASE(
    "on mpi an engine destroyed with reductions in flight, or by an exception in backward, "
    "completes them first") {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  teardown<0>(comm);
  teardown<1>(comm);
  teardown<2>(comm);
  teardown<3>(comm);
}

// A setting every rank refuses is an error raised on every rank of the job together: the
// communicators it unwinds through (a grid's, split from the world) end without aborting the job
// (before, the first one called MPI_Abort), and MPI stays usable. An error on one rank only
// still aborts (tests/backend/mpi_failure).
TEST_CASE("on mpi a setting every rank refuses unwinds through communicators without an abort") {
  Collective<Mpi> world{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  zp::EngineConfig cfg = config(2, 1);
  cfg.hpz_partition_size = world.size() + 1;
  for (const int tp : {1, 2}) {
    if (world.size() % tp) continue;
    zp::test::expect_invalid(
        [&] {
          zp::ProcessGrid<Mpi> grid(world, {.dp = world.size() / tp, .tp = tp});
          Mlp<float> model;
          zp::Engine<Mpi, float, 3> engine(grid, model, cfg);
        },
        {"engine: hpz_partition_size ", " does not divide the "});
    CHECK(zp::detail::newest_error().every_rank);
    std::int64_t one = 1;
    world.all_reduce(std::span<std::int64_t>(&one, 1), zp::ReduceOp::sum);
    CHECK(one == world.size());
    // The collective forgot the record: a rank's own later failure aborts again.
    CHECK_FALSE(zp::detail::newest_error().every_rank);
  }
}

// The process grid on MPI processes: every 2 x 2 x 1 ... arrangement of 4 (or 2) processes gives
// each rank groups whose members follow Megatron's order (the threads tests cover all grids).
TEST_CASE("on mpi a process grid splits the world into its DP, TP and PP groups") {
  Collective<Mpi> world{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  const int n = world.size(), r = world.rank();
  for (zp::GridShape s :
       {zp::GridShape{.dp = n}, zp::GridShape{.tp = n}, zp::GridShape{.pp = n},
        zp::GridShape{.dp = n / 2, .tp = 2}, zp::GridShape{.dp = n / 2, .pp = 2}}) {
    zp::ProcessGrid<Mpi> g(world, s);
    CHECK(g.coords() == zp::coords_of(s, r));
    std::int64_t sums[3] = {r, r, r};
    g.tp().all_reduce(std::span<std::int64_t>(sums, 1));
    g.dp().all_reduce(std::span<std::int64_t>(sums + 1, 1));
    g.pp().all_reduce(std::span<std::int64_t>(sums + 2, 1));
    const zp::GridCoords c = g.coords();
    std::int64_t want[3] = {0, 0, 0};
    for (int t = 0; t < s.tp; ++t) want[0] += zp::grid_rank(s, {c.dp, t, c.pp});
    for (int d = 0; d < s.dp; ++d) want[1] += zp::grid_rank(s, {d, c.tp, c.pp});
    for (int p = 0; p < s.pp; ++p) want[2] += zp::grid_rank(s, {c.dp, c.tp, p});
    CHECK(sums[0] == want[0]);
    CHECK(sums[1] == want[1]);
    CHECK(sums[2] == want[2]);
  }
}

#if ZP_TEST_IO
// Resume on MPI is exact at every stage, with gradient accumulation: 2k steps equal k steps,
// save, a fresh engine, load and k more; and the saved state reloads bitwise at another stage.
template <int Stage, int Other>
void check_mpi_resume(Collective<Mpi>& comm, const std::filesystem::path& dir) {
  CAPTURE(Stage);
  const int n = comm.size(), r = comm.rank();
  constexpr int k = 2, gas = 2;
  auto run = [&]<int S>(std::integral_constant<int, S>, int t0, int t1, bool save, bool load) {
    Mlp<zp::bf16> model;
    zp::Engine<Mpi, zp::bf16, S> e(comm, model, config(2, gas), zp::optim::AdamW{.lr = 1e-2f});
    if (load) zp::load_checkpoint(e, dir);
    for (int t = t0; t < t1; ++t)
      for (int i = 0; i < gas; ++i)
        zp::test::micro_step(e, model, (std::int64_t(t * gas + i) * n + r) * 2, 2);
    if (save) zp::save_checkpoint(e, dir, "s" + std::to_string(Stage));
    return std::make_tuple(e.gather_params(), e.gather_master(), e.gather_state(0),
                           e.gather_state(1));
  };
  const auto straight = run(std::integral_constant<int, Stage>{}, 0, 2 * k, false, false);
  const auto saved = run(std::integral_constant<int, Stage>{}, 0, k, true, false);
  CHECK(run(std::integral_constant<int, Other>{}, 0, 0, false, true) == saved);
  CHECK(run(std::integral_constant<int, Stage>{}, k, 2 * k, false, true) == straight);
}

TEST_CASE("on mpi a checkpoint resumes exactly at every stage and loads at another") {
  Collective<Mpi> comm{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)})};
  std::int64_t id = comm.rank() == 0 ? std::int64_t(::getpid()) : 0;
  comm.broadcast(std::span<std::int64_t>(&id, 1), 0);
  const auto dir = std::filesystem::temp_directory_path() / ("zp-mpi-ckpt-" + std::to_string(id));
  check_mpi_resume<0, 3>(comm, dir);
  check_mpi_resume<1, 2>(comm, dir);
  check_mpi_resume<2, 0>(comm, dir);
  check_mpi_resume<3, 1>(comm, dir);
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}
#endif

// Last in the file: from here on every host allocation of the process is a NodeHeap one.
TEST_CASE_TEMPLATE(
    "on mpi an engine whose buffers the node's peers read in place trains bitwise "
    "as through the staging segment",
    T, float, zp::bf16) {
  Collective<Mpi> staged{
      Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60), .node_direct_bytes = 0})};
  Collective<Mpi> direct{Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60),
                                              .node_direct_bytes = 1})};  // every buffer
  const bool segment = direct.backend().node_layout().per_node > 1;
  const auto check = [&](auto stage) {
    constexpr int S = decltype(stage)::value;
    CAPTURE(S);
    const std::uint64_t before = direct.backend().node_direct_calls();
    const auto a = train<T, S>(direct, close_steps, 2, 3, nullptr, true);
    CHECK((direct.backend().node_direct_calls() > before) == segment);
    CHECK(a == train<T, S>(staged, close_steps, 2, 3, nullptr, true));
    CHECK(staged.backend().node_direct_calls() == 0);
  };
  check(std::integral_constant<int, 0>{});
  check(std::integral_constant<int, 1>{});
  check(std::integral_constant<int, 2>{});
  check(std::integral_constant<int, 3>{});
}

int main(int argc, char** argv) {
  zp::backend::MpiEnvironment env(&argc, &argv);
  std::uint64_t seed = zp::test::mlp_seed();  // every process trains on rank 0's data
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  zp::test::mlp_seed() = seed;
  doctest::Context ctx(argc, argv);
  if (env.world_rank() != 0) ctx.setOption("minimal", true);
  return ctx.run();
}
