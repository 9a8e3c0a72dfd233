// zp_bench_zero: the time of one ZeRO training step per stage on the threads backend (and, under
// mpirun, on the mpi backend beside it).
//
// zero_step/stage:S/ranks:N  one optimizer step of a 51M-parameter model (8 modules) in bf16
//   with fp32 master weights and AdamW (the layout of the ZeRO formulas): module guards around a
//   synthetic forward (reads each module's parameters) and backward (writes every gradient),
//   bucket reductions, statistics, the optimizer on this rank's shard and the parameter gathers.
//   The model's compute is deliberately minimal, so the time is zp's: communication, memory
//   traffic and the optimizer. ranks:1 is the single-rank baseline (the same step, no peers).
// Counters: params (Psi), state_bytes_per_rank (16-bit params, gradients, fp32 master, optimizer
// state), comm_bus_bytes_per_rank_per_step (nccl-tests bus bytes), buckets and gathered bytes.
// Each configuration checks its memory report and communication volume against the ZeRO
// formulas before timing; iterations are timed inside the ranks (manual time, rank 0's clock
// between barriers).
//
// zeropp_step/<variant>  the stage 3 step on 4 ranks laid out as 2 nodes of 2, with ZeRO++'s qwZ
//   (int8 weight gathers), hpZ (secondary partition over the node), qgZ (int8 two-hop gradient
//   reduction), all three (also with int4 gradients, as DeepSpeed's qgZ), none (plain: every module
//   resharded after forward, max_reuse_distance 0), or hybrid sharding
//   (EngineConfig::shard_group_size: ZeRO inside each node, the gradient shard averaged across
//   them: MiCS, FSDP2's HSDP; the model's state per rank that of 2 ranks, not 4), or modules kept
//   gathered from forward to backward (EngineConfig::reshard_after_forward = false: backward
//   gathers nothing), or only the last one kept (max_reuse_distance 1, the engine's default:
//   backward's first module not gathered again). Counters, per rank per step in nccl-tests' S
//   bytes: cross_node_bytes (the data-parallel group's collectives, which span both nodes, qgZ's
//   second hop, the hybrid replicas' all_reduce), node_bytes (hpZ's gathers, qgZ's first hop, the
//   hybrid shard group's collectives), cross_vs_plain (the cross-node bytes over the plain step's,
//   measured in the same run); state_bytes_per_rank (the memory report's model states) and
//   gathered_peak_bytes (its most gathered parameters at once). link_MBps:0 has no
//   slow link between the "nodes" (the time shows the quantization's CPU cost only); link_MBps:L
//   gives each rank a simulated link of L MB/s to the other node (ThreadsOptions::link: every
//   collective lasts at least the bytes the rank moves across nodes / L). backward_ms:C: each
//   module's backward sleeps C ms more (compute elsewhere, as on a device: what the gradient
//   reductions can overlap); the others' backward is a memcpy.
#include <benchmark/benchmark.h>

#include <zp/backend/threads.hpp>
#include <zp/engine.hpp>

#include "mpi_main.hpp"
#include "synthetic.hpp"

#include <chrono>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

namespace {

using zp::bf16;
using zp::Collective;
using zp::backend::Threads;

constexpr int modules = 8;
constexpr std::size_t weight_elems = 6'400'000, bias_elems = 1'000;

struct Synthetic : zp::bench::SyntheticParams<modules> {
  std::vector<bf16> grad_w, grad_b;  // the "computed" gradient each backward writes
  float sink = 0;
  double backward_seconds = 0;  // a module's backward also sleeps this long

  Synthetic()
      : SyntheticParams(weight_elems, bias_elems),
        grad_w(weight_elems),
        grad_b(bias_elems, bf16(1e-3f)) {
    for (std::size_t i = 0; i < weight_elems; ++i) grad_w[i] = weight_grad(i);
  }
  void forward(int m) {  // touches the gathered parameters, as a layer would
    float acc = 0;
    const auto& v = w[m].value;
    for (std::size_t i = 0; i < v.size(); i += 4096) acc += float(v[i]);
    sink += acc + float(b[m].value[0]);
  }
  void backward(int m) {
    if (backward_seconds > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(backward_seconds));
    std::memcpy(static_cast<void*>(w[m].grad.data()), grad_w.data(), weight_elems * sizeof(bf16));
    std::memcpy(static_cast<void*>(b[m].grad.data()), grad_b.data(), bias_elems * sizeof(bf16));
  }
};

struct Measured {
  std::vector<double> seconds;
  double psi = 0, state_bytes = 0, bus_bytes = 0, bucket_bytes = 0, gathered_bytes = 0;
  double untracked = 0;     // the share of step time no StepTimes phase accounts for
  double direct_calls = 0;  // mpi: node-path collectives per step that read peers in place
  std::string error;
};

// The step on comm's ranks; every field is rank 0's.
template <int Stage, class B>
Measured measure(Collective<B>& comm, int iterations) {
  Measured out;
  Synthetic model;
  zp::EngineConfig cfg;        // default buckets (16 MiB), no clipping, no persistence
  cfg.max_reuse_distance = 0;  // stage 3 as ZeRO counts it (3 Psi): every module resharded
  zp::Engine<B, bf16, Stage> engine(comm, model, cfg, zp::optim::AdamW{});
  const auto first = zp::bench::train_step(engine, model);  // checked before timing
  const auto& L = engine.layout();
  const auto mem = engine.memory();
  const std::string err = zp::bench::check_first_step(engine, first, comm.size());
  const double bus = engine.last_step_comm().total().bus_bytes;
  const auto direct = [&] {
    if constexpr (requires { comm.backend().node_direct_calls(); })
      return double(comm.backend().node_direct_calls());
    return 0.0;
  };
  const double direct0 = direct();
  const auto timed = zp::bench::timed_steps(engine, model, comm, iterations);
  out.direct_calls = (direct() - direct0) / (iterations + 1);  // (timed_steps' warm-up step too)
  if (comm.rank() == 0) {
    out.seconds = timed.seconds;
    out.untracked = timed.untracked;
    out.psi = double(L.used());
    out.state_bytes = double(mem.model_states());
    out.bus_bytes = bus;
    out.bucket_bytes = double(mem.buckets);
    out.gathered_bytes = double(mem.gathered_peak);
    out.error = err;
  }
  return out;
}

template <int Stage>
Measured measure_threads(int ranks, int iterations) {
  Measured out;
  zp::backend::run_threads(ranks, [&](Collective<Threads>& comm) {
    auto m = measure<Stage>(comm, iterations);
    if (comm.rank() == 0) out = std::move(m);
  });
  return out;
}

double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0 : s / double(x.size());
}

void report(benchmark::State& state, const Measured& m) {
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(m.seconds[i++ % m.seconds.size()]);
  state.counters["params"] = m.psi;
  state.counters["state_bytes_per_rank"] = m.state_bytes;
  state.counters["comm_bus_bytes_per_rank_per_step"] = m.bus_bytes;
  state.counters["bucket_bytes"] = m.bucket_bytes;
  state.counters["gathered_peak_bytes"] = m.gathered_bytes;
  state.counters["untracked_fraction"] = m.untracked;
}

template <int Stage>
void zero_step(benchmark::State& state) {
  const auto m = measure_threads<Stage>(int(state.range(0)), int(state.max_iterations));
  if (!m.error.empty()) return state.SkipWithError(m.error.c_str());
  report(state, m);
}

#if ZP_BENCH_MPI
// zero_step_mpi/stage:S/ranks:N (under mpirun -n N): the same step with one process per rank
// (direct_calls_per_step: its node-path collectives that read the peers' buffers in place),
// then, in the same run, the step with the node path staging every byte through its segment
// (node_direct_bytes = 0: staged_ms, vs_staged = this step's mean time over that one's), with
// every collective one MPI call (shared_memory off: one_call_ms, vs_one_call) and the threads
// step with as many ranks on rank 0 while the other processes sleep (threads_ms, vs_threads).
template <int Stage>
void zero_step_mpi(benchmark::State& state) {
  const int iterations = int(state.max_iterations);
  Measured m, staged, one_call;
  {
    Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD)};
    m = measure<Stage>(comm, iterations);
  }
  {
    zp::backend::Mpi::Options opt;
    opt.node_direct_bytes = 0;
    Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD, opt)};
    staged = measure<Stage>(comm, iterations);
  }
  zp::backend::Mpi::Options plain;
  plain.shared_memory = false;
  Collective<zp::backend::Mpi> comm{zp::backend::Mpi(MPI_COMM_WORLD, plain)};
  one_call = measure<Stage>(comm, iterations);
  Measured t;
  if (comm.rank() == 0) t = measure_threads<Stage>(comm.size(), iterations);
  MPI_Request done;  // the others wait without spinning on a core the threads step needs
  MPI_Ibarrier(MPI_COMM_WORLD, &done);
  for (int flag = 0; !flag;) {
    MPI_Test(&done, &flag, MPI_STATUS_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (comm.rank() != 0) {
    for (auto _ : state) state.SetIterationTime(1);
    return;
  }
  if (!m.error.empty()) return state.SkipWithError(m.error.c_str());
  report(state, m);
  state.counters["threads_ms"] = mean(t.seconds) * 1e3;
  state.counters["vs_threads"] = mean(m.seconds) / mean(t.seconds);
  state.counters["direct_calls_per_step"] = m.direct_calls;
  state.counters["staged_ms"] = mean(staged.seconds) * 1e3;
  state.counters["vs_staged"] = mean(m.seconds) / mean(staged.seconds);
  state.counters["one_call_ms"] = mean(one_call.seconds) * 1e3;
  state.counters["vs_one_call"] = mean(m.seconds) / mean(one_call.seconds);
}

template <int Stage>
void register_mpi_stage(int ranks) {
  benchmark::RegisterBenchmark(
      ("zero_step_mpi/stage:" + std::to_string(Stage) + "/ranks:" + std::to_string(ranks)).c_str(),
      zero_step_mpi<Stage>)
      ->Iterations(3)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}
#endif

// A stage 3 step's bytes (S, per rank) that cross the 2 nodes and that stay inside one.
struct Traffic {
  double cross = 0, node = 0;
};
template <class E>
Traffic step_traffic(E& engine, Collective<Threads>& comm, Synthetic& model) {
  auto bytes = [](zp::Collective<Threads>* c) { return c ? double(c->stats().total().bytes) : 0; };
  // Hybrid sharding's shard group is a node, its replicas span the nodes.
  auto* shard = engine.replicas() ? &engine.comm() : nullptr;
  const auto cross = [&] {
    return bytes(&comm) + bytes(engine.qgz_cross_group()) + bytes(engine.replicas());
  };
  const auto node = [&] {
    return bytes(engine.hpz_group()) + bytes(engine.qgz_node_group()) + bytes(shard);
  };
  const double cross0 = cross(), node0 = node();
  zp::bench::train_step(engine, model);
  return {cross() - cross0, node() - node0};
}

enum class ZeroPP { plain, qwz, hpz, qgz, all, all_int4, hybrid, kept, last_kept };

zp::EngineConfig zeropp_config(ZeroPP v) {
  zp::EngineConfig cfg;
  cfg.ranks_per_node = 2;
  const bool all = v == ZeroPP::all || v == ZeroPP::all_int4;
  if (v == ZeroPP::qwz || all) cfg.quantized_weights = zp::zero_quantized_weights;
  if (v == ZeroPP::hpz || all) cfg.hpz_partition_size = 2;
  if (v == ZeroPP::qgz || all) cfg.quantized_gradients = zp::zero_quantized_gradients;
  if (v == ZeroPP::all_int4) cfg.quantized_gradients->bits = zp::quant::Bits::int4;
  if (v == ZeroPP::hybrid) cfg.shard_group_size = 2;
  cfg.reshard_after_forward = v != ZeroPP::kept;
  cfg.max_reuse_distance = v == ZeroPP::last_kept ? 1 : 0;
  return cfg;
}

void zeropp_step(benchmark::State& state) {
  const auto v = ZeroPP(state.range(0));
  zp::backend::ThreadsOptions opt;
  opt.link = {2, double(state.range(1)) * 1e6};
  std::vector<double> times;
  Traffic plain, mine;
  double state_bytes = 0, gathered_peak = 0;
  zp::backend::run_threads(
      4,
      [&](Collective<Threads>& comm) {
        Traffic p;
        {
          Synthetic base;
          zp::Engine<Threads, bf16, 3> engine(comm, base, zeropp_config(ZeroPP::plain));
          zp::bench::train_step(engine, base);
          p = step_traffic(engine, comm, base);
        }
        Synthetic model;
        model.backward_seconds = double(state.range(2)) / 1e3;
        zp::Engine<Threads, bf16, 3> engine(comm, model, zeropp_config(v));
        zp::bench::train_step(engine, model);
        const Traffic t = step_traffic(engine, comm, model);
        auto s = zp::bench::timed_steps(engine, model, comm, int(state.max_iterations)).seconds;
        if (comm.rank() == 0) {
          times = s;
          plain = p;
          mine = t;
          state_bytes = double(engine.memory().model_states());
          gathered_peak = double(engine.memory().gathered_peak);
        }
      },
      opt);
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(times[i++ % times.size()]);
  state.counters["cross_node_bytes"] = mine.cross;
  state.counters["node_bytes"] = mine.node;
  state.counters["cross_vs_plain"] = mine.cross / plain.cross;
  state.counters["state_bytes_per_rank"] = state_bytes;
  state.counters["gathered_peak_bytes"] = gathered_peak;
}

// Names: zeropp_step/variant:V/link_MBps:L/backward_ms:C/iterations:3/manual_time (V: 0 plain,
// 1 qwZ, 2 hpZ, 3 qgZ, 4 all, 5 all with int4 gradients as DeepSpeed's qgZ, 6 hybrid sharding
// over the nodes (MiCS), 7 not resharded after forward, 8 the last module kept; L: 0 no simulated
// link, else each rank's link to the other node in MB/s; C: each module's backward also sleeps
// C ms, a model that computes elsewhere (as on a device) while its gradients are reduced)
// and zero_step/stage:S/ranks:N/iterations:3/manual_time.
template <int Stage>
void register_stage(std::initializer_list<int> ranks) {
  auto* b = benchmark::RegisterBenchmark(("zero_step/stage:" + std::to_string(Stage)).c_str(),
                                         zero_step<Stage>);
  b->ArgName("ranks")->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
  for (int r : ranks) b->Arg(r);
}

void register_local() {
  benchmark::RegisterBenchmark("zeropp_step", zeropp_step)
      ->ArgNames({"variant", "link_MBps", "backward_ms"})
      ->ArgsProduct({{0, 1, 2, 3, 4, 5, 6, 7, 8}, {0, 1000, 250}, {0}})
      ->ArgsProduct({{0, 3, 4, 6, 7, 8}, {250}, {40}})
      ->Iterations(3)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  register_stage<0>({1, 2, 4});
  register_stage<1>({2, 4});
  register_stage<2>({2, 4});
  register_stage<3>({2, 4});
}

}  // namespace

int main(int argc, char** argv) {
  return zp::bench::mpi_main(
      argc, argv,
      [](int ranks) {
#if ZP_BENCH_MPI
        register_mpi_stage<0>(ranks);
        register_mpi_stage<1>(ranks);
        register_mpi_stage<2>(ranks);
        register_mpi_stage<3>(ranks);
#else
        (void)ranks;
#endif
      },
      register_local);
}
