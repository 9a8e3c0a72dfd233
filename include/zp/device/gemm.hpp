// zp/device/gemm.hpp: C = alpha op(A) op(B) + beta C in fp32, column-major (cuBLAS's Sgemm
// convention), enqueued on a stream: cuBLAS on a GPU (link CUDA::cublas), one work item per
// element of C on the simulated device. With beta = 0, C is not read (it may hold garbage).
#pragma once

#include <algorithm>
#include <cstddef>

#include "zp/device/runtime.hpp"
#include "zp/error.hpp"

#if !defined(ZP_DEVICE_SIM)
#include <cublas_v2.h>

#include <map>
#endif

namespace zp::device {

namespace gemm_detail {
#if defined(ZP_DEVICE_SIM)
struct Element {  // C[i, j] for work item i + j * m, the dot product in k order
  bool ta, tb;
  int m, k;
  float alpha, beta;
  const float* a;
  int lda;
  const float* b;
  int ldb;
  float* c;
  int ldc;
  ZP_HOST_DEVICE void operator()(std::size_t item) const {
    const std::size_t i = item % std::size_t(m), j = item / std::size_t(m);
    float acc = 0;
    for (std::size_t p = 0; p < std::size_t(k); ++p)
      acc += (ta ? a[p + i * lda] : a[i + p * lda]) * (tb ? b[j + p * ldb] : b[p + j * ldb]);
    float& out = c[i + j * ldc];
    out = beta == 0 ? alpha * acc : alpha * acc + beta * out;
  }
};
#else
// This thread's cuBLAS handle on the current device, created on first use.
inline cublasHandle_t handle() {
  struct Handles {
    std::map<int, cublasHandle_t> by_device;
    ~Handles() {
      for (auto& [d, h] : by_device) cublasDestroy(h);
    }
  };
  thread_local Handles handles;
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  cublasHandle_t& h = handles.by_device[d];
  if (!h && cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    h = nullptr;
    throw Error(Errc::cuda, "cublasCreate failed");
  }
  return h;
}
#endif
}  // namespace gemm_detail

inline void gemm(stream_t s, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                 const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  ZP_EXPECT(m >= 0 && n >= 0 && k >= 0, "gemm: sizes m=", m, ", n=", n, ", k=", k,
            " must not be negative");
  ZP_EXPECT(lda >= std::max(1, trans_a ? k : m) && ldb >= std::max(1, trans_b ? n : k) &&
                ldc >= std::max(1, m),
            "gemm: leading dimensions lda=", lda, ", ldb=", ldb, ", ldc=", ldc,
            " are below the rows of op(A) (", trans_a ? k : m, "), op(B) (", trans_b ? n : k,
            ") and C (", m, ")");
  if (m == 0 || n == 0) return;
#if defined(ZP_DEVICE_SIM)
  launch(s, std::size_t(m) * std::size_t(n),
         gemm_detail::Element{trans_a, trans_b, m, k, alpha, beta, a, lda, b, ldb, c, ldc});
#else
  const cublasHandle_t h = gemm_detail::handle();
  cublasStatus_t st = cublasSetStream(h, s);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasSgemm(h, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, m,
                     n, k, &alpha, a, lda, b, ldb, &beta, c, ldc);
  if (st != CUBLAS_STATUS_SUCCESS)
    throw Error(
        Errc::cuda,
        zp::detail::cat("cublasSgemm (m=", m, ", n=", n, ", k=", k, ") failed: status ", int(st)),
        int(st));
#endif
}

}  // namespace zp::device
