// bench/cuda_copy.hpp: the GPU benchmarks' baseline, a device-to-device copy measured in the same
// run, and their event timer. Built with nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <map>

namespace zp::bench {

inline void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Seconds per call of f() on the default stream: CUDA events around `launches` calls, after one
// warm-up call.
template <class F>
double timed(F&& f, int launches = 10) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "cudaEventCreate");
  ok(cudaEventCreate(&b), "cudaEventCreate");
  f();
  ok(cudaEventRecord(a), "cudaEventRecord");
  for (int i = 0; i < launches; ++i) f();
  ok(cudaEventRecord(b), "cudaEventRecord");
  ok(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return double(ms) * 1e-3 / launches;
}

// cudaMemcpyAsync device to device of `bytes`, in GB/s counting bytes read + bytes written;
// measured once per size in this run.
inline double copy_gbps(std::size_t bytes) {
  static std::map<std::size_t, double> seen;
  if (auto it = seen.find(bytes); it != seen.end()) return it->second;
  void *src = nullptr, *dst = nullptr;
  ok(cudaMalloc(&src, bytes), "cudaMalloc");
  ok(cudaMalloc(&dst, bytes), "cudaMalloc");
  ok(cudaMemset(src, 1, bytes), "cudaMemset");
  const double t = timed(
      [&] { ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync"); });
  cudaFree(src);
  cudaFree(dst);
  return seen[bytes] = 2.0 * double(bytes) / t / 1e9;
}

}  // namespace zp::bench
