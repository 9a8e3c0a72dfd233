// zp_bench_zero_cuda: one ZeRO training step per stage on one GPU, N ranks as threads sharing it
// (zp/backend/cuda_threads.hpp), against the same kernels without the engine.
//
// zero_step_gpu/stage:S/ranks:N  one optimizer step of a 134M-parameter model (8 modules) in bf16
//   with fp32 master weights and AdamW: module guards around a synthetic forward (a kernel that
//   reads each module's parameters) and backward (a device copy that writes every gradient),
//   bucket reductions, statistics, the optimizer on this rank's shard and the parameter gathers,
//   all on the device. Counters:
//     kernels_ms         the same work as bare calls in the same run: the gradient copies, one
//                        collective over the whole gradient (stage 0: all_reduce; else
//                        reduce_scatter), the statistics, their all_reduce and the step gate,
//                        one optimizer kernel over the whole shard, the gathers (stage 1/2 one all_gather,
//                        stage 3 two, forward and backward); no buckets, guards or bookkeeping;
//     engine_vs_kernels  the engine's step time over kernels_ms (the goal: at most 1.15);
//     params, state_bytes_per_rank (checked against the ZeRO formula before timing),
//     comm_bus_bytes_per_rank_per_step (nccl-tests bus bytes), device_bytes_per_rank (what the
//     allocator serves the rank, zp::memory_use).
// zero_offload_gpu/stage:S/ranks:N  the same step with ZeRO-Offload (fp32 master and AdamW state
//   in host memory, updated by the CPU step); vs_gpu_step is its time over the device step's,
//   measured in the same run.
// zero_offload_param_gpu/stage:3/ranks:2/optimizer:O  the same step with the parameter shard in
//   page-locked host memory (offload_param: cpu; copied up for each gather, written by the
//   device's AdamW kernel through the mapping, or with O = 1 by the CPU step of ZeRO-Offload);
//   vs_gpu_step as above; device_bytes_per_rank comes out 2 Psi/N bytes (the bf16 shard) under
//   the device step's (on an H200: 1.108 GB against 1.242 GB, bench/RESULTS.md).
// Times: rank 0's host clock around a step, between barriers, after its compute stream drained
// (manual time); each configuration first checks that the step applies and that its memory and
// bus bytes follow the ZeRO formulas.
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <utility>
#include <cmath>
#include <string>
#include <vector>

#include "zp/backend/cuda_threads.hpp"
#include "zp/device/memory.hpp"
#include "zp/engine.hpp"
#include "synthetic.hpp"

namespace zero_cuda {

using zp::bf16;
using zp::Collective;
using zp::backend::CudaThreads;
using Dev = zp::Memory<zp::MemorySpace::device>;
using DevStep = zp::ShardStep<zp::MemorySpace::device>;
template <class T>
using DevBuf = zp::Buffer<T, zp::MemorySpace::device>;

constexpr int modules = 8;
constexpr std::size_t weight_elems = 16'777'216, bias_elems = 4'096;

void ok(cudaError_t e, const char* what) { zp::device::check(e, what); }

__global__ void touch_kernel(const bf16* w, std::size_t n, float* sink) {
  float acc = 0;  // reads one element per 4096, as the CPU bench's forward
  for (std::size_t i = threadIdx.x * 4096; i < n; i += std::size_t(blockDim.x) * 4096)
    acc += float(w[i]);
  if (acc == 12345.0f) *sink = acc;  // never true; keeps the reads
}

struct Synthetic : zp::bench::SyntheticParams<modules> {
  DevBuf<bf16> grad_w{weight_elems}, grad_b{bias_elems};  // the "computed" gradients
  DevBuf<float> sink{1};

  Synthetic() : SyntheticParams(weight_elems, bias_elems) {
    std::vector<bf16> g(weight_elems);
    for (std::size_t i = 0; i < weight_elems; ++i) g[i] = weight_grad(i);
    const std::vector<bf16> gb(bias_elems, bf16(1e-3f));
    Dev::from_host(grad_w.span(), std::span<const bf16>(g));
    Dev::from_host(grad_b.span(), std::span<const bf16>(gb));
  }
  void forward(int m) { touch(w[m].value.data()); }
  void backward(int m) { write_grads(w[m].grad.data(), b[m].grad.data()); }
  // The same on any buffers (the bare step's).
  void touch(const bf16* weights) {
    touch_kernel<<<1, 256, 0, zp::device::current_stream()>>>(weights, weight_elems, sink.data());
    ok(cudaGetLastError(), "touch kernel launch");
  }
  void write_grads(bf16* gw, bf16* gb) {
    Dev::copy(std::span<bf16>(gw, weight_elems), std::span<const bf16>(grad_w.span()));
    Dev::copy(std::span<bf16>(gb, bias_elems), std::span<const bf16>(grad_b.span()));
  }
};

// The same step as bare calls on whole-model buffers (see the top of this file).
template <int Stage>
struct Bare {
  std::size_t P, shard;
  int n, rank;
  DevBuf<bf16> params, grads, gathered;
  DevBuf<float> master, m, v;
  DevBuf<double> stats{zp::detail::StepGate::statistics + 2};

  Bare(std::size_t total, int ranks, int r)
      : P(total),
        shard(total / std::size_t(ranks)),
        n(ranks),
        rank(r),
        params(Stage < 3 ? P : shard),
        grads(P),
        gathered(Stage == 3 ? P : 0),
        master(Stage < 1 ? P : shard),
        m(Stage < 1 ? P : shard),
        v(Stage < 1 ? P : shard) {
    for (auto* b : {&master, &m, &v}) Dev::zero(b->span());
    Dev::zero(params.span());
    Dev::zero(grads.span());
  }
  void step(Collective<CudaThreads>& comm, Synthetic& model, const zp::optim::AdamW& opt,
            std::int64_t t) {
    const std::size_t mod = weight_elems + bias_elems;
    if constexpr (Stage == 3)
      comm.all_gather(std::span<const bf16>(params.span()), gathered.span());
    for (int k = 0; k < modules; ++k)
      model.touch((Stage == 3 ? gathered : params).data() + std::size_t(k) * mod);
    if constexpr (Stage == 3)
      comm.all_gather(std::span<const bf16>(params.span()), gathered.span());
    for (int k = modules - 1; k >= 0; --k)
      model.write_grads(grads.data() + std::size_t(k) * mod,
                        grads.data() + std::size_t(k) * mod + weight_elems);
    if constexpr (Stage == 0)
      comm.all_reduce(grads.span(), zp::ReduceOp::avg);
    else
      comm.reduce_scatter(grads.span(), zp::ReduceOp::avg);
    const std::span<bf16> g =
        Stage == 0 ? grads.span() : grads.span(std::size_t(rank) * shard, shard);
    constexpr std::size_t k = zp::detail::StepGate::statistics;
    double host[k + 2] = {};
    Dev::from_host(stats.span(), std::span<const double>(host));
    const std::span<const bf16> grads[] = {g};
    DevStep::statistics(std::span<const std::span<const bf16>>(grads), stats.data(), {});
    comm.all_reduce(stats.span(0, k), zp::ReduceOp::sum);
    Dev::invoke(zp::detail::StepGate{double(n), 0, 0, 1.0f, 0.0f}, stats.data());
    zp::optim::ShardView<bf16, bf16> view;
    view.master = master.span();
    view.grad = g;
    view.param =
        Stage == 0 || Stage == 3 ? params.span() : params.span(std::size_t(rank) * shard, shard);
    view.state[0] = m.span();
    view.state[1] = v.span();
    DevStep::update(opt, zp::optim::StepScalars{t, 1.0f}, std::span(&std::as_const(view), 1), {},
                    stats.data() + k);
    if constexpr (Stage == 1 || Stage == 2) comm.all_gather(params.span());
    Dev::to_host(std::span<double>(host),
                 std::span<const double>(stats.span()));  // the step's one sync
  }
};

struct Measured {
  double seconds = 0, kernels = 0, psi = 0, state_bytes = 0, bus_bytes = 0, device_bytes = 0;
  std::string error;
};

// Seconds of `iterations` calls of f() on every rank, rank 0's clock, median.
template <class F>
double timed(Collective<CudaThreads>& comm, int iterations, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < iterations; ++i) {
    zp::device::synchronize(zp::device::current_stream(), "bench");
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    zp::device::synchronize(zp::device::current_stream(), "bench");
    comm.barrier();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <int Stage>
Measured measure(int ranks, int iterations, bool offload, bool offload_param = false) {
  Measured out;
  zp::backend::run_cuda_threads(ranks, [&](Collective<CudaThreads>& comm) {
    const std::int64_t base = zp::memory_use<zp::MemorySpace::device>().current;
    Synthetic model;
    zp::EngineConfig cfg;        // default buckets (16 MiB), no clipping, no persistence
    cfg.max_reuse_distance = 0;  // every module resharded: the bare kernels' two gathers
    cfg.offload_optimizer = offload;
    cfg.offload_param = offload_param;
    const std::int64_t model_bytes = zp::memory_use<zp::MemorySpace::device>().current - base;
    std::string err;
    double seconds = 0, bus = 0, psi = 0, state = 0, held = 0;
    std::size_t total = 0;  // the padded layout, which divides by the ranks
    {
      zp::Engine<CudaThreads, bf16, Stage> engine(comm, model, cfg, zp::optim::AdamW{});
      const auto first = zp::bench::train_step(engine, model);  // checked before timing
      err = zp::bench::check_first_step(engine, first, comm.size());
      const auto& L = engine.layout();
      bus = engine.last_step_comm().total().bus_bytes;
      seconds = timed(comm, iterations, [&] { zp::bench::train_step(engine, model); });
      psi = double(L.used());
      total = L.total();
      state = double(engine.memory().model_states());
      held = double(zp::memory_use<zp::MemorySpace::device>().current - base - model_bytes);
    }
    double kernels = 0;
    if (!offload && !offload_param) {
      Bare<Stage> bare(total, comm.size(), comm.rank());
      std::int64_t t = 0;
      bare.step(comm, model, {}, ++t);
      kernels = timed(comm, iterations, [&] { bare.step(comm, model, {}, ++t); });
    }
    if (comm.rank() == 0) out = {seconds, kernels, psi, state, bus, held, err};
  });
  return out;
}

// Runs the measurement; an error becomes the row's error instead of ending the program.
template <class F>
bool guarded(benchmark::State& state, F&& f) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return false;
  }
}

template <int Stage>
void zero_step_gpu(benchmark::State& state) {
  Measured m;
  if (!guarded(state, [&] { m = measure<Stage>(int(state.range(0)), 5, false); })) return;
  if (!m.error.empty()) return state.SkipWithError(m.error.c_str());
  for (auto _ : state) state.SetIterationTime(m.seconds);
  state.counters["kernels_ms"] = m.kernels * 1e3;
  state.counters["engine_vs_kernels"] = m.seconds / m.kernels;
  state.counters["params"] = m.psi;
  state.counters["state_bytes_per_rank"] = m.state_bytes;
  state.counters["comm_bus_bytes_per_rank_per_step"] = m.bus_bytes;
  state.counters["device_bytes_per_rank"] = m.device_bytes;
}

// The step offloaded as `optimizer` and `params` say, against the device step in the same run.
template <int Stage>
void offloaded_step(benchmark::State& state, bool optimizer, bool params) {
  const int ranks = int(state.range(0));
  Measured gpu, off;
  if (!guarded(state, [&] {
        gpu = measure<Stage>(ranks, 5, false), off = measure<Stage>(ranks, 5, optimizer, params);
      }))
    return;
  if (!off.error.empty()) return state.SkipWithError(off.error.c_str());
  for (auto _ : state) state.SetIterationTime(off.seconds);
  state.counters["vs_gpu_step"] = off.seconds / gpu.seconds;
  state.counters["device_bytes_per_rank"] = off.device_bytes;
}

template <int Stage>
void zero_offload_gpu(benchmark::State& state) {
  offloaded_step<Stage>(state, true, false);
}

void zero_offload_param_gpu(benchmark::State& state) {
  offloaded_step<3>(state, state.range(1) != 0, true);
}

const bool registered = [] {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("zp_bench_zero_cuda: no CUDA device, nothing to measure\n");
    return false;
  }
  for (auto [name, fn] : {std::pair{"zero_step_gpu/stage:0", &zero_step_gpu<0>},
                          {"zero_step_gpu/stage:1", &zero_step_gpu<1>},
                          {"zero_step_gpu/stage:2", &zero_step_gpu<2>},
                          {"zero_step_gpu/stage:3", &zero_step_gpu<3>}})
    benchmark::RegisterBenchmark(name, fn)
        ->ArgName("ranks")
        ->Arg(1)
        ->Arg(2)
        ->Arg(4)
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("zero_offload_gpu/stage:2", &zero_offload_gpu<2>)
      ->ArgName("ranks")
      ->Arg(1)
      ->Arg(2)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("zero_offload_gpu/stage:3", &zero_offload_gpu<3>)
      ->ArgName("ranks")
      ->Arg(2)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("zero_offload_param_gpu/stage:3", &zero_offload_param_gpu)
      ->ArgNames({"ranks", "optimizer"})
      ->Args({2, 0})
      ->Args({2, 1})
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace zero_cuda

BENCHMARK_MAIN();
