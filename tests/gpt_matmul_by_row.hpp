// tests/gpt_matmul_by_row.hpp: examples/gpt.hpp's matmuls as they were before they were blocked,
// one row (token) at a time: the reference tests/gpt.test.cpp checks the blocked ones against bit
// for bit, and the baseline zp_bench_gpt times them against.
#pragma once

#include "gpt.hpp"

namespace gpt::by_row {

// y = x W + b (b may be null).
inline void matmul_forward(float* y, const float* x, const float* w, const float* b, int rows,
                           int in, int out) {
  for (int n = 0; n < rows; ++n) {
    float* yn = y + row_major(n, 0, out);
    for (int o = 0; o < out; ++o) yn[o] = b ? b[o] : 0.0f;
    for (int i = 0; i < in; ++i) {
      const float xi = x[row_major(n, i, in)];
      const float* wi = w + row_major(i, 0, out);
      for (int o = 0; o < out; ++o) yn[o] += xi * wi[o];
    }
  }
}

// dx = dy W^T, dW += x^T dy, db += the column sums of dy.
inline void matmul_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                            const float* w, int rows, int in, int out) {
  for (int n = 0; n < rows; ++n) {
    const float* dyn = dy + row_major(n, 0, out);
    for (int o = 0; o < out; ++o) db[o] += dyn[o];
    for (int i = 0; i < in; ++i) {
      float* dwi = dw + row_major(i, 0, out);
      const float xi = x[row_major(n, i, in)];
      for (int o = 0; o < out; ++o) dwi[o] += xi * dyn[o];
      dx[row_major(n, i, in)] = dot(dyn, w + row_major(i, 0, out), out);
    }
  }
}

}  // namespace gpt::by_row
