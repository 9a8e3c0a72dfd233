// zp/detail/reduce.hpp: the host reduction loops of the untyped core, shared by the threads
// backend (reducing across ranks' buffers in place) and the mpi backend's 16-bit path, and the
// element math and slicing cuda_threads shares with the threads backend.
// 16-bit floats accumulate in float across all inputs and round once at the end.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

#include "zp/collective.hpp"
#include "zp/dtype.hpp"

namespace zp::detail {

// Rank `rank`'s slice of [0, count) when each of `ranks` ranks reduces its own slice across
// every rank's buffers (threads, cuda_threads): equal parts cut at 64-element boundaries, so no
// two ranks write one cache line.
inline std::pair<std::size_t, std::size_t> rank_slice(std::size_t count, int rank,
                                                      int ranks) noexcept {
  const auto [b0, b1] = even_part((count + 63) / 64, ranks, rank);
  return {std::min(count, b0 * 64), std::min(count, b1 * 64)};
}

template <class T>
struct accum {
  using type = T;
};
template <>
struct accum<bf16> {
  using type = float;
};
template <>
struct accum<fp16> {
  using type = float;
};

// One element of a (op) b in the accumulation type: the reduction math of every backend that
// reduces itself (threads on the host; cuda_threads on the device, which must agree bit for bit).
// avg sums here and divides once at the end (finish_one).
template <ReduceOp Op, class A>
ZP_HOST_DEVICE inline A combine_one(A a, A b) {
  if constexpr (Op == ReduceOp::max) {
    return a < b ? b : a;
  } else if constexpr (Op == ReduceOp::min) {
    return b < a ? b : a;
  } else if constexpr (std::is_integral_v<A>) {
    // Integer sums wrap around (two's complement), as MPI's do in practice: defined here,
    // where signed overflow would be undefined behaviour.
    using U = std::make_unsigned_t<A>;
    return A(U(a) + U(b));
  } else {
    return a + b;
  }
}
template <class A>
ZP_HOST_DEVICE inline A finish_one(A acc, ReduceOp op, int ranks) {
  return op == ReduceOp::avg ? acc / A(ranks) : acc;
}

// acc = a (op) b, element-wise; acc may be a (the running accumulator), and the first combine of
// a chunk reads two inputs directly, so no separate load pass touches memory.
template <class A>
inline void combine(A* acc, const A* a, const A* b, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (std::size_t i = 0; i < n; ++i) acc[i] = combine_one<ReduceOp::sum>(a[i], b[i]);
      break;
    case ReduceOp::max:
      for (std::size_t i = 0; i < n; ++i) acc[i] = combine_one<ReduceOp::max>(a[i], b[i]);
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = combine_one<ReduceOp::min>(a[i], b[i]);
      break;
  }
}

template <class T, class A>
inline void load(A* acc, const T* x, std::size_t n) {
  if constexpr (std::is_same_v<T, A>) {
    std::memcpy(acc, x, n * sizeof(T));
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] = A(x[i]);
  }
}

template <class T, class A>
inline void store(T* out, const A* acc, std::size_t n) {
  if constexpr (std::is_same_v<T, A>) {
    std::memcpy(out, acc, n * sizeof(T));
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = T(acc[i]);
  }
}

template <class T>
using accum_t = typename accum<T>::type;

// One stretch of a rank-order reduction: acc = init (op) in[0] (op) ... (op) in[n_in-1] for the n
// elements, where init (in the accumulation type) is what the ranks before these reduced to, or
// nullptr when in[0] is rank 0's input. With n_out > 0 this stretch ends the reduction: avg
// divides by `ranks` (how many inputs there were in all) and the result is stored to every out[k];
// otherwise the accumulator goes to acc_out for the next stretch (the mpi backend's next node).
// So the result is identical on every rank and every run however the ranks are cut into
// stretches. An output may alias an input or init (in-place collectives): each chunk is read
// completely before any of it is written.
template <class T>
void reduce_chunks(const accum_t<T>* init, const T* const* in, int n_in, T* const* out, int n_out,
                   accum_t<T>* acc_out, std::size_t n, ReduceOp op, int ranks) {
  using A = accum_t<T>;
  constexpr std::size_t chunk = 2048;
  alignas(64) A acc[chunk];
  alignas(64) A tmp[chunk];
  for (std::size_t lo = 0; lo < n; lo += chunk) {
    const std::size_t m = std::min(chunk, n - lo);
    int r = 0;
    if constexpr (std::is_same_v<T, A>) {
      if (init) {
        combine(acc, init + lo, in[0] + lo, m, op);
        r = 1;
      } else if (n_in >= 2) {
        combine(acc, in[0] + lo, in[1] + lo, m, op);
        r = 2;
      } else {
        load(acc, in[0] + lo, m);
        r = 1;
      }
    } else if (init) {
      load(acc, init + lo, m);
    } else {
      load(acc, in[0] + lo, m);
      r = 1;
    }
    for (; r < n_in; ++r) {
      if constexpr (std::is_same_v<T, A>) {
        combine(acc, acc, in[r] + lo, m, op);
      } else {
        load(tmp, in[r] + lo, m);
        combine(acc, acc, tmp, m, op);
      }
    }
    if (n_out == 0) {
      std::memcpy(acc_out + lo, acc, m * sizeof(A));
      continue;
    }
    if (op == ReduceOp::avg)
      for (std::size_t i = 0; i < m; ++i) acc[i] = finish_one(acc[i], op, ranks);
    for (int k = 0; k < n_out; ++k) store(out[k] + lo, acc, m);
  }
}

// The whole reduction over in[0..n_in) in rank order, stored to every out[k] (threads).
template <class T>
void reduce_chunks(const T* const* in, int n_in, T* const* out, int n_out, std::size_t n,
                   ReduceOp op) {
  reduce_chunks<T>(nullptr, in, n_in, out, n_out, nullptr, n, op, n_in);
}

// Backends that reduce 16-bit floats through a float staging buffer (mpi): widen the input, and
// narrow the reduced values once, rounding to nearest even, after the avg division if any.
inline void widen_16bit(const void* src, DType t, float* out, std::size_t n) {
  if (t == DType::bf16)
    load(out, static_cast<const bf16*>(src), n);
  else
    load(out, static_cast<const fp16*>(src), n);
}
inline void narrow_16bit(float* stage, DType t, void* dst, std::size_t n, int divisor) {
  if (divisor)
    for (std::size_t i = 0; i < n; ++i) stage[i] = stage[i] / float(divisor);
  if (t == DType::bf16)
    store(static_cast<bf16*>(dst), stage, n);
  else
    store(static_cast<fp16*>(dst), stage, n);
}

}  // namespace zp::detail
