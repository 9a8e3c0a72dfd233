// zp/optim/cuda.cuh: the fused optimizer step and gradient statistics on the GPU (nvcc only).
//
// Same element math as the CPU path (optim/optimizer.hpp), so a step on the GPU gives the same
// bits as zp::optim::cpu::step (IEEE division and square root: do not build with
// --use_fast_math). One kernel family, templated on the optimizer, the model type T and the
// gradient type G; each thread handles 4 consecutive elements per iteration with 128-bit loads of
// the fp32 arrays (64-bit for 16-bit arrays) when every pointer is 16-byte aligned, and a
// grid-stride loop over blocks sized to fill the device.
//
// No host synchronisation: grad_stats accumulates the squared norm and an overflow flag in
// device memory, and step reads the flag on the device and returns without touching memory
// when it is set. grad_mul may also come from device memory (a clip coefficient computed on
// the device after an all_reduce of the norm).
#pragma once

#if !defined(__CUDACC__)
#error "zp/optim/cuda.cuh needs nvcc; the host-only path is zp/optim/cpu.hpp"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "zp/error.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/stream.hpp"

namespace zp::optim::cuda {

// Where a step finds its device-side inputs.
struct DeviceScalars {
  const int* overflow = nullptr;      // nonzero: skip the step (nullptr: never skip)
  const float* grad_mul = nullptr;    // if set, multiplies StepScalars::grad_mul
  // The engine's step gate, two doubles: [0] multiplies StepScalars::grad_mul, [1] nonzero:
  // skip the step (memory.hpp, Ops::step).
  const double* gate = nullptr;
};

namespace detail {
using optim::detail::Step;

using zp::device::check;

inline constexpr int block_size = 256;

// Blocks that fill the device: a few resident blocks per SM (grid-stride loops cover the rest).
inline int grid_for(std::size_t work_items) {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const std::size_t want = (work_items + block_size - 1) / block_size;
  const std::size_t most = std::size_t(sms) * 8;
  return int(want < 1 ? 1 : want < most ? want : most);
}

template <class X>
struct Pack4;  // 4 consecutive elements, loaded and stored as one access
template <> struct alignas(16) Pack4<float> { float x[4]; };
template <> struct alignas(8) Pack4<bf16> { bf16 x[4]; };
template <> struct alignas(8) Pack4<fp16> { fp16 x[4]; };

template <class T, class G>
struct Buffers {
  float* master;
  const G* grad;
  float* state0;
  float* state1;
  T* param;
  int slots;
};

template <class O, class T, class G>
__device__ inline void element(const Step<O>& c, const Buffers<T, G>& b, std::size_t i) {
  float p = b.master[i];
  float s[2] = {0.0f, 0.0f};
  if (b.slots > 0) s[0] = b.state0[i];
  if (b.slots > 1) s[1] = b.state1[i];
  optim::detail::update(c, optim::detail::to_float(b.grad[i]), p, s);
  b.master[i] = p;
  if (b.slots > 0) b.state0[i] = s[0];
  if (b.slots > 1) b.state1[i] = s[1];
  b.param[i] = optim::detail::from_float<T>(p);
}

template <class O, class T, class G>
__global__ void __launch_bounds__(block_size)
    step_kernel(Step<O> c, Buffers<T, G> b, std::size_t n, bool vectorized, DeviceScalars dev) {
  if (dev.overflow != nullptr && *dev.overflow != 0) return;  // the whole step is skipped
  if (dev.gate != nullptr && dev.gate[1] != 0) return;
  if (dev.grad_mul != nullptr) c.grad_mul *= *dev.grad_mul;
  if (dev.gate != nullptr) c.grad_mul *= float(dev.gate[0]);
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  const std::size_t first = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vectorized) {
    const std::size_t packs = n / 4;
    for (std::size_t k = first; k < packs; k += stride) {
      Pack4<float> p = reinterpret_cast<const Pack4<float>*>(b.master)[k];
      const Pack4<G> g = reinterpret_cast<const Pack4<G>*>(b.grad)[k];
      Pack4<float> s0{}, s1{};
      if (b.slots > 0) s0 = reinterpret_cast<const Pack4<float>*>(b.state0)[k];
      if (b.slots > 1) s1 = reinterpret_cast<const Pack4<float>*>(b.state1)[k];
      Pack4<T> out;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float s[2] = {s0.x[j], s1.x[j]};
        optim::detail::update(c, optim::detail::to_float(g.x[j]), p.x[j], s);
        s0.x[j] = s[0];
        s1.x[j] = s[1];
        out.x[j] = optim::detail::from_float<T>(p.x[j]);
      }
      reinterpret_cast<Pack4<float>*>(b.master)[k] = p;
      if (b.slots > 0) reinterpret_cast<Pack4<float>*>(b.state0)[k] = s0;
      if (b.slots > 1) reinterpret_cast<Pack4<float>*>(b.state1)[k] = s1;
      reinterpret_cast<Pack4<T>*>(b.param)[k] = out;
    }
    for (std::size_t i = packs * 4 + first; i < n; i += stride) element(c, b, i);  // the < 4 tail
  } else {
    for (std::size_t i = first; i < n; i += stride) element(c, b, i);
  }
}

// An overflow flag as an int (set to 1) or as a double (counted: the engine all_reduces it with
// the norm, in one buffer of doubles).
__device__ inline void raise_flag(int* f) { atomicOr(f, 1); }
__device__ inline void raise_flag(double* f) { atomicAdd(f, 1.0); }

template <class G, class Flag>
__global__ void __launch_bounds__(block_size)
    stats_kernel(const G* grad, std::size_t n, double* sumsq, Flag* overflow) {
  using Reduce = cub::BlockReduce<double, block_size>;
  __shared__ typename Reduce::TempStorage tmp;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  double acc = 0;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double x = optim::detail::to_float(grad[i]);
    acc += x * x;
  }
  const double block = Reduce(tmp).Sum(acc);
  if (threadIdx.x == 0) {
    atomicAdd(sumsq, block);
    // An inf or nan anywhere makes the block's sum inf or nan.
    if (!isfinite(block)) raise_flag(overflow);
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace detail

// Adds the squared norm of `grad` (as stored) to *sumsq and ORs 1 into *overflow when any value
// is inf or nan; both in device memory, zeroed by the caller before the first shard. Enqueued on
// `stream`, no synchronisation.
template <class G>
void grad_stats(std::span<const G> grad, double* sumsq, int* overflow, cudaStream_t stream) {
  if (grad.empty()) return;
  const int blocks = detail::grid_for(grad.size());
  detail::stats_kernel<G, int><<<blocks, detail::block_size, 0, stream>>>(grad.data(), grad.size(), sumsq, overflow);
  detail::check(cudaGetLastError(), "optimizer grad_stats launch");
}

// The same into stats[0] (squared norm) and stats[1] (+1 per block that saw an inf or nan), as
// the engine's statistics buffer holds them.
template <class G>
void grad_stats(std::span<const G> grad, double* stats, cudaStream_t stream) {
  if (grad.empty()) return;
  const int blocks = detail::grid_for(grad.size());
  detail::stats_kernel<G, double><<<blocks, detail::block_size, 0, stream>>>(grad.data(), grad.size(), stats, stats + 1);
  detail::check(cudaGetLastError(), "optimizer grad_stats launch");
}

// One optimizer step over a shard in device memory, enqueued on `stream`. When *dev.overflow is
// nonzero at run time nothing is written. Throws zp::Error(invalid_argument) on mismatched sizes.
template <class Opt, class T, class G>
  requires Optimizer<Opt>
void step(const Opt& opt, const StepScalars& s, const ShardView<T, G>& shard, const DeviceScalars& dev,
          cudaStream_t stream) {
  const std::size_t n = shard.master.size();
  ZP_EXPECT(shard.grad.size() == n && shard.param.size() == n, "optimizer step: sizes differ: master ",
            n, ", grad ", shard.grad.size(), ", param ", shard.param.size());
  detail::Buffers<T, G> b{shard.master.data(), shard.grad.data(), nullptr, nullptr, shard.param.data(), 0};
  for (int k = 0; k < 2; ++k) {
    if (!optim::detail::uses_slot(opt, k)) break;
    ZP_EXPECT(shard.state[std::size_t(k)].size() == n, "optimizer step: state[", k, "] has ",
              shard.state[std::size_t(k)].size(), " elements, master has ", n);
    (k == 0 ? b.state0 : b.state1) = shard.state[std::size_t(k)].data();
    b.slots = k + 1;
  }
  ZP_EXPECT(s.step >= 1, "optimizer step: step must count from 1, got ", s.step);
  if (n == 0) return;
  const bool vectorized = detail::aligned16(b.master) && detail::aligned16(b.grad) &&
                          detail::aligned16(b.param) && (b.slots < 1 || detail::aligned16(b.state0)) &&
                          (b.slots < 2 || detail::aligned16(b.state1));
  const int blocks = detail::grid_for(vectorized ? (n + 3) / 4 : n);
  detail::step_kernel<Opt, T, G><<<blocks, detail::block_size, 0, stream>>>(
      optim::detail::prepare(opt, s), b, n, vectorized, dev);
  detail::check(cudaGetLastError(), "optimizer step launch");
}

}  // namespace zp::optim::cuda
