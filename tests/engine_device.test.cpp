// The engine on device memory (zp/device/memory.hpp), on a GPU (built as engine_gpu.test.cu with
// nvcc, label gpu) or on the simulated device (this file with g++, label sim, several scheduler
// seeds, also under ASan and TSan). A model whose backward is a device launch trains 4 steps
// (2 micro-steps each) at every stage, in fp32 and bf16, with 1, 2 and 4 cuda_threads ranks (and
// on a GPU the nccl backend at world size 1); its parameters and fp32 master weights equal bit for
// bit those of the threads backend on the CPU with as many ranks fed the same gradients (the same
// formula on host and device, without contracted multiply-adds), with and without ZeRO-Offload
// (and, where zp::aio is linked, with the optimizer state on NVMe), and at stage 3 with ZeRO++'s
// secondary partition (hpZ) over pairs of ranks, and with quantized gathers (qwZ) and, at stages
// 2 and 3, quantized gradient reductions (qgZ) against the threads backend's quantized runs.
// The model's launches run on a compute stream of their own, the collectives on the backends'
// communication streams; ordering is proven by delaying each kind of stream in turn, which must
// change no bit (on the simulator its adversarial scheduler delays every stream besides). The
// engine synchronises with the host once per optimizer step (device::sync_count) and never
// inside a micro-step, and the bytes its allocator serves each rank are its memory report and
// the ZeRO formulas (tests/memory_check.hpp). With clipping on, the two agree to rounding (the
// bound is at check_clipping). Checkpoints and safetensors exports of a device
// engine (with and without offload) load into the CPU engine and back, bit for bit. Without a
// device it exits 77 (skip).
#include <doctest/doctest.h>

#include "bit_difference.hpp"
#include "device_or_skip.hpp"
#include "expect_error.hpp"
#include "huge_model.hpp"
#include "memory_check.hpp"
#include "temp_dir.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "random.hpp"
#include "zp/backend/cuda_threads.hpp"
#include "zp/backend/threads.hpp"
#include "zp/checkpoint.hpp"
#include "zp/device/memory.hpp"
#include "zp/engine.hpp"
#include "zp/grid.hpp"
#if ZP_TEST_NCCL
#include "zp/backend/nccl.hpp"
#endif

// A named namespace: nvcc warns about internal-linkage friends the Model concept only declares.
namespace engine_gpu {

const int devices = zp::test::devices_or_skip("the device engine tests");  // before doctest's main

// The gradient a micro-step adds to element i of parameter p: a hash of (seed, step, micro, p,
// i) in [-1, 1) plus 0.05 x the current value, with every product and sum rounded separately
// (__fmul_rn/__fadd_rn never fuse), so host and device compute the same float.
ZP_HOST_DEVICE inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
ZP_HOST_DEVICE inline float grad_of(std::uint64_t key, std::size_t i, float value) {
  const float u = float(mix(key + i) >> 40) * 0x1.0p-23f - 1.0f;  // 24 bits: exact in float
#ifdef __CUDA_ARCH__
  return __fadd_rn(u, __fmul_rn(0.05f, value));
#else
  return u + 0.05f * value;
#endif
}

template <class T>
struct AddGrad {  // the backward of one parameter, element i
  T* grad;
  const T* value;
  std::uint64_t key;
  ZP_HOST_DEVICE void operator()(std::size_t i) const {
    grad[i] = T(float(grad[i]) + grad_of(key, i, float(value[i])));
  }
};

// Three modules of a few parameters each (sizes that do not divide the alignment).
template <class T>
struct Fed {
  std::vector<zp::Param<T>> params;
  std::vector<std::vector<T>> init;
  std::vector<int> module_of;  // of each parameter

  explicit Fed(std::uint64_t seed) {
    const std::size_t sizes[] = {1000, 37, 4096, 5, 777, 3000};
    for (std::size_t p = 0; p < 6; ++p) {
      params.emplace_back(sizes[p]);
      init.emplace_back(sizes[p]);
      for (std::size_t i = 0; i < sizes[p]; ++i)
        init[p][i] = T(zp::test::hash_uniform(seed + p, i));
      module_of.push_back(int(p / 2));
    }
    for (std::size_t p = 0; p < 6; ++p) params[p].value.rebind(init[p].data());
  }
  template <class V>
  friend void for_each_parameter(Fed& m, V&& visit) {
    for (std::size_t p = 0; p < m.params.size(); ++p)
      visit("p" + std::to_string(p), m.module_of[p], m.params[p]);
  }
  static std::uint64_t key(std::uint64_t seed, int step, int micro, std::size_t p) {
    return mix(seed ^ mix((std::uint64_t(step) * 16 + std::uint64_t(micro)) * 16 + p));
  }
  // Module m's backward: on the device (the current stream) or the host, by the memory space.
  template <zp::MemorySpace S>
  void backward(int m, std::uint64_t seed, int step, int micro) {
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (module_of[p] != m) continue;
      auto& v = params[p];
      const AddGrad<T> f{v.grad.data(), v.value.data(), key(seed, step, micro, p)};
      if constexpr (S == zp::MemorySpace::device) {
        const zp::device::stream_t s = zp::device::current_stream();
        zp::device::before_enqueue(s, zp::device::Role::compute);  // the delay test mode's turn
        zp::device::launch(s, v.size(), f);
      } else {
        for (std::size_t i = 0; i < v.size(); ++i) f(i);
      }
    }
  }
};

// offload: 0 none, 1 the optimizer state in host memory (ZeRO-Offload), 2 in swap files
// (ZeRO-Infinity; programs with zp::aio), sub-groups of 2048 elements, pipelined; plus
// params_offloaded (stage 3): the parameter shard in host memory too, or, with 2, in a swap file.
constexpr int params_offloaded = 4;
// ZeRO++ (stage 3): hpz, the secondary partition over groups of that many ranks; qwz, the
// gathers quantized (int8 in blocks of 64, so pieces hold several blocks and a short one).
struct ZeroPP {
  int hpz = 1;
  bool qwz = false;
  bool qgz = false;  // the gradients' reduce_scatter quantized, over nodes of 2 ranks (stage 2, 3)
  int shard = 0;     // hybrid sharding: ZeRO over groups of that many ranks (stages 1-3)
  bool zero_init = false;  // the initial values from EngineConfig::initializer, none in the model
  bool keep = false;       // stage 3: modules kept gathered from forward to backward
  std::size_t reuse = 0;   // stage 3: max_reuse_distance (1: the last module kept)
};
zp::EngineConfig config(int offload = 0, float max_grad_norm = 0, ZeroPP zpp = {}) {
  static const zp::test::TempDir swap("engine_device_swap");
  zp::EngineConfig c;
  c.hpz_partition_size = zpp.hpz;
  c.shard_group_size = zpp.shard;
  c.reshard_after_forward = !zpp.keep;
  c.max_reuse_distance = zpp.reuse;
  if (zpp.qwz) c.quantized_weights = zp::quant::Format{.bits = zp::quant::Bits::int8, .block = 64};
  if (zpp.qgz) {
    c.quantized_gradients = zp::quant::Format{.bits = zp::quant::Bits::int4, .block = 64};
    c.ranks_per_node = 2;
  }
  c.offload_optimizer = (offload & 3) > 0;
  if ((offload & 3) == 2)
    c.optimizer_nvme = zp::NvmeOptions{
        .path = swap.path, .pipeline_read = true, .pipeline_write = true, .sub_group_size = 1024};
  c.offload_param = (offload & params_offloaded) != 0;
  if (c.offload_param && c.optimizer_nvme) c.param_nvme = zp::NvmeOptions{.path = swap.path};
  c.max_grad_norm = max_grad_norm;
  // p1, p3 and p4 take no weight decay: each module's step has views of both kinds.
  c.weight_decay_filter = [](std::string_view n) { return n != "p1" && n != "p3" && n != "p4"; };
  c.batch = {.micro_batch_per_rank = 1, .gradient_accumulation_steps = 2};
  c.bucket_bytes = 8192;
  c.first_bucket_bytes = 2048;
  return c;
}

struct Out {
  std::vector<float> master;
  std::vector<std::uint8_t> params;  // the T bytes
  std::uint64_t syncs_in_micro_steps = 0, syncs_per_step_max = 0;
  std::vector<double> grad_norms;  // of every applied step
};

// The steps of a run: every step after the first meets the state the ones before it left (Adam's
// moments and bias corrections, reused buffers), and more steps rerun the same code. This test
// is CI's costliest (some 150 trainings a seed, three runs): 12 steps took half the time of 20,
// 8 about 0.72 of 12, and 4 under TSan about 0.45 of 8.
constexpr int steps = 4;

// A checkpoint in the middle of training: saved as "mid" before step steps / 2, or loaded from
// it (training then runs the rest), and an export of the result (parameters or master).
struct Ckpt {
  std::filesystem::path dir;
  bool load = false;
  std::filesystem::path export_to;  // empty: none
  bool master = false;
};

template <class T, int Stage, class B>
Out train(zp::Collective<B>& comm, std::uint64_t seed, int offload = 0, const Ckpt* ckpt = nullptr,
          float max_grad_norm = 0, ZeroPP zpp = {}) {
  constexpr zp::MemorySpace S = B::memory;
  Fed<T> model(seed);
  const std::uint64_t grads =
      seed + 7919 * std::uint64_t(comm.rank() + 1);  // each rank's own gradients
  const zp::test::MeasuredMemory<S> measured;
  const std::int64_t pinned = zp::memory_use<zp::MemorySpace::pinned>().current;
  zp::EngineConfig cfg = config(offload, max_grad_norm, zpp);
  if (zpp.zero_init) {  // Fed's values, each rank's kept elements from their source
    for (auto& p : model.params) p.value.rebind(nullptr);
    cfg.initializer = [seed](std::string_view name, std::size_t first, std::span<float> out) {
      const std::uint64_t p = std::stoull(std::string(name.substr(1)));  // "p<k>"
      for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = zp::test::hash_uniform(seed + p, first + i);
    };
  }
  zp::Engine<B, T, Stage> engine(comm, model, cfg,
                                 zp::optim::AdamW{.lr = 1e-2f, .weight_decay = 0.1f});
  if (S == zp::MemorySpace::device && (offload & params_offloaded) && (offload & 3) != 2) {
    // the parameter shard page-locked in host memory, and reported so (with AdamW's master, m
    // and v where the optimizer is offloaded too)
    const std::size_t n = engine.layout().shard();
    CHECK(zp::memory_use<zp::MemorySpace::pinned>().current - pinned ==
          std::int64_t(n * sizeof(T)));
    CHECK(engine.memory().offloaded == n * sizeof(T) + ((offload & 3) ? 3 * n * 4 : 0));
  }
  measured.start(engine);
  Out out;
  int first = 0;
  if (ckpt && ckpt->load) {
    measured.outside([&] { zp::load_checkpoint(engine, ckpt->dir, "mid"); });
    first = steps / 2;
  }
  for (int step = first; step < steps; ++step) {
    if (ckpt && !ckpt->load && step == steps / 2)
      measured.outside([&] { zp::save_checkpoint(engine, ckpt->dir, "mid"); });
    for (int micro = 0; micro < 2; ++micro) {
      std::uint64_t before = 0;
      if constexpr (S == zp::MemorySpace::device) before = zp::device::sync_count();
      for (int m = 0; m < 3; ++m) auto g = engine.forward(m);
      for (int m = 2; m >= 0; --m) {
        auto g = engine.backward(m);
        model.template backward<S>(m, grads, step, micro);
      }
      if constexpr (S == zp::MemorySpace::device)
        out.syncs_in_micro_steps += zp::device::sync_count() - before;
      const zp::StepResult r = engine.step();
      if (r.applied) out.grad_norms.push_back(r.grad_norm);
      if constexpr (S == zp::MemorySpace::device)
        out.syncs_per_step_max =
            std::max<std::uint64_t>(out.syncs_per_step_max, zp::device::sync_count() - before);
    }
  }
  if (zpp.hpz > 1) {  // the backward gathers ran inside the group, from the secondary shards
    REQUIRE(engine.hpz_group() != nullptr);
    CHECK(engine.hpz_group()->stats()[zp::CollOp::all_gather].bytes > 0);
  }
  // bf16 at stage 0 accumulates its 2 micro-steps in fp32 (an extra gradient copy)
  measured.check(engine, engine.comm().size(), std::is_same_v<T, zp::bf16> && Stage == 0);
  if constexpr (S == zp::MemorySpace::device)  // the device's pool serves every rank
    CHECK(zp::device::memory_in_use() >= zp::memory_use<S>().current - measured.base);
  if (ckpt && !ckpt->export_to.empty())
    zp::export_safetensors(engine, ckpt->export_to, {.master = ckpt->master});
  out.master = engine.gather_master();
  const std::vector<T> p = engine.gather_params();
  out.params.resize(p.size() * sizeof(T));
  std::memcpy(out.params.data(), p.data(), out.params.size());
  return out;
}

// offloaded: the step may wait for the device more than once (the CPU step waits for each
// piece's gradient), the micro-steps still never.
// A failure names the first master that differs and how many do.
void expect_equal(const Out& gpu, const Out& cpu, bool offloaded = false) {
  REQUIRE(gpu.master.size() == cpu.master.size());
  const zp::test::BitDifference d = zp::test::bit_difference(gpu.master, cpu.master);
  if (d.count)
    MESSAGE(d.count, " of ", cpu.master.size(), " masters differ, the first at ", d.first, ": ",
            gpu.master[d.first], " against ", cpu.master[d.first]);
  CHECK(d.count == 0);
  CHECK(gpu.params == cpu.params);
  CHECK(gpu.syncs_in_micro_steps == 0);
  if (!offloaded) CHECK(gpu.syncs_per_step_max == 1);
}

// Runs fn with every stream of role r idle for `late` before each enqueue there.
template <class F>
auto delayed(zp::device::Role r, F&& fn) {
  constexpr std::chrono::microseconds late{20};  // longer than this test's kernels on a GPU
  zp::device::delay_streams(r, late);
  struct Off {
    zp::device::Role r;
    ~Off() { zp::device::delay_streams(r, {}); }
  } off{r};
  return fn();
}

template <class T, int Stage>
Out on_gpu(int n, std::uint64_t seed, int offload = 0, ZeroPP zpp = {}) {
  Out gpu;
  zp::backend::run_cuda_threads(n, [&](zp::Collective<zp::backend::CudaThreads>& comm) {
    Out o = train<T, Stage>(comm, seed, offload, nullptr, 0, zpp);
    if (comm.rank() == 0) gpu = std::move(o);
  });
  return gpu;
}

// 1, 2 and 4 ranks on the one device against as many thread ranks (rank 0's results; every rank
// gathers the same whole model); at 2 ranks also with each kind of stream delayed, and offloaded.
template <class T, int Stage>
void check_ranks(std::uint64_t seed) {
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    Out cpu;
    zp::backend::run_threads(n, [&](zp::Collective<zp::backend::Threads>& comm) {
      Out o = train<T, Stage>(comm, seed);
      if (comm.rank() == 0) cpu = std::move(o);
    });
    expect_equal(on_gpu<T, Stage>(n, seed), cpu);  // sync_count is per thread: rank 0's own
    // ZeRO++ on the device: hpZ alone (stage 3) is bitwise the run without it (the backward
    // gathers run inside groups of 2, from the secondary shards the forward gathers left); with
    // qgZ (stages 2, 3: the reduce_scatter's quantized hops) and qwZ (stage 3: the gathers
    // quantized) on too, bitwise the threads backend's run of the same (the work items there,
    // quantize's AVX2 path on the CPU: the same bits), also with each kind of stream delayed.
    if (Stage == 3 && n > 1) {
      CAPTURE("hpz 2");
      expect_equal(on_gpu<T, Stage>(n, seed, 0, {.hpz = 2}), cpu);
      // Modules kept gathered from forward to backward: the same values, so the same bits.
      CAPTURE("not resharded after forward");
      expect_equal(on_gpu<T, Stage>(n, seed, 0, {.keep = true}), cpu);
      CAPTURE("the last module kept");
      expect_equal(on_gpu<T, Stage>(n, seed, 0, {.reuse = 1}), cpu);
      if (n == 2)  // gathered from pieces copied up from page-locked host memory
        expect_equal(on_gpu<T, Stage>(n, seed, params_offloaded, {.keep = true}), cpu, true);
    }
    if (Stage >= 2 && n > 1) {
      const ZeroPP all{.hpz = Stage == 3 ? 2 : 1, .qwz = Stage == 3, .qgz = true};
      CAPTURE("zero++");
      Out quantized;
      zp::backend::run_threads(n, [&](zp::Collective<zp::backend::Threads>& comm) {
        Out o = train<T, Stage>(comm, seed, 0, nullptr, 0, all);
        if (comm.rank() == 0) quantized = std::move(o);
      });
      CHECK(quantized.params != cpu.params);  // the quantization shows
      expect_equal(on_gpu<T, Stage>(n, seed, 0, all), quantized);
      if (Stage == 3 && n == 2) {  // the quantized gathers of offloaded (copied up) pieces
        CAPTURE("zero++, parameters offloaded");
        expect_equal(on_gpu<T, Stage>(n, seed, params_offloaded, all), quantized);
      }
      if (n == 2)
        for (auto role : {zp::device::Role::comm, zp::device::Role::compute}) {
          CAPTURE(int(role));
          expect_equal(delayed(role, [&] { return on_gpu<T, Stage>(n, seed, 0, all); }), quantized);
        }
    }
    // Hybrid sharding on the device: ZeRO inside groups of 2 ranks, the gradient pieces averaged
    // across the groups on the comm stream; bitwise the threads backend's run of the same, also
    // with each kind of stream delayed.
    if (Stage >= 1 && n == 4) {
      CAPTURE("shard groups of 2");
      Out hybrid;
      zp::backend::run_threads(n, [&](zp::Collective<zp::backend::Threads>& comm) {
        Out o = train<T, Stage>(comm, seed, 0, nullptr, 0, {.shard = 2});
        if (comm.rank() == 0) hybrid = std::move(o);
      });
      expect_equal(on_gpu<T, Stage>(n, seed, 0, {.shard = 2}), hybrid);
      for (auto role : {zp::device::Role::comm, zp::device::Role::compute}) {
        CAPTURE(int(role));
        expect_equal(delayed(role, [&] { return on_gpu<T, Stage>(n, seed, 0, {.shard = 2}); }),
                     hybrid);
      }
    }
    if (n != 2) continue;
    // ZeRO-Init: the kept elements from the initializer, copied up (stage 3 with the parameter
    // shard offloaded: into page-locked memory); the same bits.
    {
      CAPTURE("zero-init");
      expect_equal(on_gpu<T, Stage>(n, seed, 0, {.zero_init = true}), cpu);
      if (Stage == 3)
        expect_equal(on_gpu<T, Stage>(n, seed, params_offloaded, {.zero_init = true}), cpu, true);
    }
    for (auto role : {zp::device::Role::comm, zp::device::Role::compute}) {
      CAPTURE(int(role));
      expect_equal(delayed(role, [&] { return on_gpu<T, Stage>(n, seed); }), cpu);
    }
    // ZeRO-Offload: master and state on the host, the CPU step; ZeRO-Infinity (stages 1 and 3,
    // to keep the sanitizer runs short): in swap files, stepped sub-group by sub-group through
    // pinned staging; the same bits again. Stage 3 also with the parameter shard offloaded:
    // page-locked, stepped there by the device (4) or the CPU (5), or in a swap file (6).
    for (int offload : {1, 2, 4, 5, 6}) {
#if !defined(ZP_WITH_AIO)
      if ((offload & 3) == 2) continue;
#endif
      if (offload == 2 && Stage % 2 == 0) continue;
      if ((offload & params_offloaded) && Stage != 3) continue;
      CAPTURE(offload);
      expect_equal(on_gpu<T, Stage>(n, seed, offload), cpu, true);
    }
  }
}

// Clipping on (max_grad_norm far under the gradients' norm, so every step clips): the device's
// squared norm is a reduction in another order than the CPU's, so the clip factor, and the
// update from it, may differ in the last bits. Stated bound: the norms agree to 1e-12
// (relative), and every master weight is within 64 ulps of the CPU engine's (float spacing at
// its magnitude); the parameters follow from the masters (not compared bitwise).
template <class T, int Stage>
void check_clipping(std::uint64_t seed) {
  CAPTURE(Stage);
  constexpr float max_norm = 1e-3f;
  for (int n : {1, 2}) {
    CAPTURE(n);
    Out cpu, gpu;
    zp::backend::run_threads(n, [&](zp::Collective<zp::backend::Threads>& comm) {
      Out o = train<T, Stage>(comm, seed, 0, nullptr, max_norm);
      if (comm.rank() == 0) cpu = std::move(o);
    });
    zp::backend::run_cuda_threads(n, [&](zp::Collective<zp::backend::CudaThreads>& comm) {
      Out o = train<T, Stage>(comm, seed, 0, nullptr, max_norm);
      if (comm.rank() == 0) gpu = std::move(o);
    });
    REQUIRE(cpu.grad_norms.size() == std::size_t(steps));
    REQUIRE(gpu.grad_norms.size() == std::size_t(steps));
    for (std::size_t k = 0; k < cpu.grad_norms.size(); ++k) {
      CHECK(cpu.grad_norms[k] > 10 * max_norm);  // the step clipped
      CHECK(gpu.grad_norms[k] == doctest::Approx(cpu.grad_norms[k]).epsilon(1e-12));
    }
    REQUIRE(gpu.master.size() == cpu.master.size());
    double worst = 0;  // in ulps
    for (std::size_t i = 0; i < cpu.master.size(); ++i) {
      const float c = cpu.master[i], ulp = std::nextafter(std::fabs(c), INFINITY) - std::fabs(c);
      const double e = double(std::fabs(gpu.master[i] - c)) / double(ulp);
      if (!(e <= worst)) worst = e;  // a NaN is the worst
    }
    MESSAGE("clipping, stage ", Stage, ", ", n, " ranks: masters within ", worst, " ulps");
    CHECK(worst <= 64);
    CHECK(gpu.syncs_per_step_max == 1);
  }
}

#if ZP_TEST_NCCL
// nccl at world size 1: the model on a compute stream of its own, the collectives on nccl's.
template <class T, int Stage>
Out on_nccl(zp::Collective<zp::backend::Nccl>& comm, std::uint64_t seed, int offload = 0) {
  zp::device::Stream compute;
  zp::device::StreamScope on(compute.get());
  Out o = train<T, Stage>(comm, seed, offload);
  zp::device::synchronize(compute.get(), "test");
  return o;
}

template <class T, int Stage>
void check_stage(std::uint64_t seed) {
  CAPTURE(Stage);
  Out cpu;
  zp::backend::run_threads(
      1, [&](zp::Collective<zp::backend::Threads>& comm) { cpu = train<T, Stage>(comm, seed); });
  zp::Collective<zp::backend::Nccl> comm(
      zp::backend::Nccl::create(zp::backend::Nccl::unique_id(), 0, 1, 0));
  expect_equal(on_nccl<T, Stage>(comm, seed), cpu);
  for (auto role : {zp::device::Role::comm, zp::device::Role::compute}) {
    CAPTURE(int(role));
    expect_equal(delayed(role, [&] { return on_nccl<T, Stage>(comm, seed); }), cpu);
  }
  // ZeRO-Offload: master and state on the host, the CPU step; at stage 3 the parameter shard
  // too (page-locked, stepped there by the device's kernel, then by the CPU); the same bits.
  for (int offload : {1, 4, 5}) {
    if ((offload & params_offloaded) && Stage != 3) continue;
    CAPTURE(offload);
    expect_equal(on_nccl<T, Stage>(comm, seed, offload), cpu, true);
  }
  check_ranks<T, Stage>(seed);
}
#else
template <class T, int Stage>
void check_stage(std::uint64_t seed) {
  CAPTURE(Stage);
  check_ranks<T, Stage>(seed);
}
#endif

std::vector<char> file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A device engine's checkpoint loads into the CPU engine and the reverse (offloaded, so master
// and state, and at stage 3 the parameters, pass through host memory on the device side too);
// training goes on to the same bits, and the two sides export the same safetensors bytes.
template <class T, int Stage>
void check_checkpoints(std::uint64_t seed) {
  CAPTURE(Stage);
  zp::test::TempDir dir("engine_gpu");
  auto gpu = [&](const Ckpt& c, int offload) {
    Out o;
    zp::backend::run_cuda_threads(2, [&](zp::Collective<zp::backend::CudaThreads>& comm) {
      Out r = train<T, Stage>(comm, seed, offload, &c);
      if (comm.rank() == 0) o = std::move(r);
    });
    return o;
  };
  auto cpu = [&](const Ckpt& c) {
    Out o;
    zp::backend::run_threads(2, [&](zp::Collective<zp::backend::Threads>& comm) {
      Out r = train<T, Stage>(comm, seed, 0, &c);
      if (comm.rank() == 0) o = std::move(r);
    });
    return o;
  };
  // Stage 3 with the parameter shard offloaded on the device side: saved from and loaded into
  // host memory (or a swap file).
  const int params = Stage == 3 ? params_offloaded : 0;
  const Out a = gpu({dir.path / "from_gpu", false, dir.path / "gpu_params"}, params);
  const Out b = cpu({dir.path / "from_gpu", true, dir.path / "cpu_params"});
  CHECK(a.params == b.params);
  CHECK(std::memcmp(a.master.data(), b.master.data(), a.master.size() * sizeof(float)) == 0);
  CHECK(file_bytes(dir.path / "gpu_params" / "model.safetensors") ==
        file_bytes(dir.path / "cpu_params" / "model.safetensors"));
  const Out c = cpu({dir.path / "from_cpu", false, dir.path / "cpu_master", true});
#if defined(ZP_WITH_AIO)
  constexpr int offload = 2;  // the loaded state goes to swap files
#else
  constexpr int offload = 1;
#endif
  const Out d = gpu({dir.path / "from_cpu", true, dir.path / "gpu_master", true}, offload | params);
  CHECK(c.params == d.params);
  CHECK(std::memcmp(c.master.data(), d.master.data(), c.master.size() * sizeof(float)) == 0);
  CHECK(file_bytes(dir.path / "gpu_master" / "model.safetensors") ==
        file_bytes(dir.path / "cpu_master" / "model.safetensors"));
}

}  // namespace engine_gpu

using namespace engine_gpu;

// Two cuda_threads ranks share one device. Model states (stage 0, bf16, AdamW: 16 bytes an
// element on the device) of 0.7 of its free memory each fit one rank, not both: both ranks are
// refused, naming the device and their needs, before either allocates; so are the 4 ranks of a
// 2 x 2 grid whose data-parallel groups fit alone. On the simulator, with a 64 MiB limit where it
// has none.
TEST_CASE("model states past a device's free memory are refused on every rank, naming it") {
  using Dev = zp::Allocator<zp::MemorySpace::device>;
#if defined(ZP_DEVICE_SIM)
  struct Limit {
    Limit() {
      auto o = zp::device::sim::options_from_env();
      if (!o.memory_limit) o.memory_limit = std::size_t(64) << 20;
      zp::device::sim::configure(o);
    }
    ~Limit() { zp::device::sim::configure(zp::device::sim::options_from_env()); }
  } limit;
#endif
  using B = zp::backend::CudaThreads;
  const auto build = [](zp::Collective<B>& comm, std::size_t n) {
    zp::test::Huge model(n);
    zp::EngineConfig cfg;
    cfg.initializer = zp::test::huge_values;
    zp::Engine<B, zp::bf16, 0> engine(comm, model, cfg);
    CHECK(engine.memory_plan().device.total() == 16 * engine.layout().total());
  };
  zp::backend::run_cuda_threads(2, [&](zp::Collective<B>& comm) {
    std::int64_t room = 0;
    if (comm.rank() == 0) room = Dev::room().bytes;
    zp::all_reduce_host(comm, std::span<std::int64_t>(&room, 1), zp::ReduceOp::sum);
    REQUIRE(room > 0);
    const std::int64_t before = zp::memory_use<zp::MemorySpace::device>().current;
    zp::test::expect_error(zp::Errc::out_of_memory,
                           [&] { build(comm, std::size_t(room) * 7 / 10 / 16); },
                           {"not enough device memory: ranks 0, 1 need ", "free on ",
                            "this rank's ", "optimizer state"});
    CHECK(zp::memory_use<zp::MemorySpace::device>().current == before);  // nothing allocated
    build(comm, std::min<std::size_t>(std::size_t(room) / 10 / 16, 1 << 20));
  });
  // A grid of 2 data-parallel x 2 tensor-parallel ranks: each data-parallel group of 2 fits (0.35
  // each), the 4 ranks on the device do not, and the check counts them all.
  zp::backend::run_cuda_threads(4, [&](zp::Collective<B>& world) {
    zp::ProcessGrid<B> grid(world, {.dp = 2, .tp = 2, .pp = 1});
    std::int64_t room = 0;
    if (world.rank() == 0) room = Dev::room().bytes;
    zp::all_reduce_host(world, std::span<std::int64_t>(&room, 1), zp::ReduceOp::sum);
    const std::size_t n = std::size_t(room) * 35 / 100 / 16;
    zp::test::expect_error(zp::Errc::out_of_memory,
                           [&] {
                             zp::test::Huge model(n);
                             zp::EngineConfig cfg;
                             cfg.initializer = zp::test::huge_values;
                             zp::Engine<B, zp::bf16, 0> engine(grid, model, cfg);
                           },
                           {"not enough device memory: ranks 0, 1, 2, 3 need ", "free on "});
  });
}

#if defined(ZP_DEVICE_SIM)
// ZeRO-Offload's page-locked staging is allocated by the first step. Where that fails on one rank
// (the simulator's fail_pinned: the next cudaMallocHost, whichever rank makes it), the step fails
// on every rank, agreed on, and every engine is unusable (that rank's shard may be half
// updated); before, that rank alone threw and the other waited in the parameters' all_gather.
TEST_CASE("ZeRO-Offload's step failing on one rank fails on every rank, which then agree") {
  using B = zp::backend::CudaThreads;
  struct FailPinned {
    explicit FailPinned(std::uint64_t n) { zp::device::sim::fail_pinned(n); }
    ~FailPinned() { zp::device::sim::fail_pinned(0); }
  };
  std::optional<FailPinned> fail;
  const std::uint64_t seed = zp::test::run_seed("engine_device.test offload failure");
  // The agreement is every rank's or none's: offloaded on some ranks only is refused.
  zp::backend::run_cuda_threads(2, [&](zp::Collective<B>& comm) {
    Fed<float> model(seed);
    zp::test::expect_invalid(
        [&] { zp::Engine<B, float, 2> e(comm, model, config(comm.rank() == 1 ? 1 : 0)); },
        {"differ in their optimizer state or parameters on NVMe, or the optimizer offloaded on a "
         "device backend (this rank: no state, no params on NVMe, ",
         comm.rank() == 1 ? "offloaded)" : "not offloaded)"});
  });
  zp::backend::run_cuda_threads(2, [&](zp::Collective<B>& comm) {
    Fed<float> model(seed);
    zp::Engine<B, float, 2> engine(comm, model, config(1), zp::optim::AdamW{.lr = 1e-2f});
    const std::uint64_t grads = seed + std::uint64_t(comm.rank());
    for (int micro = 0; micro < 2; ++micro) {
      if (micro == 1) {  // the next page-locked allocation is the step's staging, on one rank
        comm.barrier();
        if (comm.rank() == 0) fail.emplace(1);
        comm.barrier();
      }
      for (int m = 0; m < 3; ++m) auto g = engine.forward(m);
      for (int m = 2; m >= 0; --m) {
        auto g = engine.backward(m);
        model.template backward<B::memory>(m, grads, 0, micro);
      }
      if (micro == 0) CHECK(!engine.step().boundary);
    }
    zp::test::expect_error(zp::Errc::cuda, [&] { engine.step(); },
                           {"simulated device: cudaMallocHost of ", "fail_pinned"});
    zp::test::expect_invalid([&] { auto g = engine.forward(0); },
                             {"unusable since the optimizer step offloaded to the CPU failed"});
    comm.barrier();  // the ranks still agree on their collectives
  });
}
#endif

TEST_CASE_TEMPLATE(
    "the engine on one device (1, 2, 4 cuda_threads ranks; on a GPU nccl at world size 1) equals "
    "the CPU engine bit for bit",
    T, float, zp::bf16) {
  const std::uint64_t seed = zp::test::run_seed("engine_device.test");
  check_stage<T, 0>(seed);
  check_stage<T, 1>(seed);
  check_stage<T, 2>(seed);
  check_stage<T, 3>(seed);
}

TEST_CASE_TEMPLATE("with clipping the device engine equals the CPU engine to rounding", T, float,
                   zp::bf16) {
  const std::uint64_t seed = zp::test::run_seed("engine_device.test");
  check_clipping<T, 0>(seed);
  check_clipping<T, 3>(seed);
}

TEST_CASE_TEMPLATE("a device engine's checkpoints and exports match the CPU engine's", T, float,
                   zp::bf16) {
  const std::uint64_t seed = zp::test::run_seed("engine_device.test");
  check_checkpoints<T, 0>(seed);
  check_checkpoints<T, 1>(seed);
  check_checkpoints<T, 3>(seed);
}
