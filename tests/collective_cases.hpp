// Backend-independent checks of Collective<B> on host memory, shared by the threads and mpi
// tests. Every rank derives every rank's input from (seed, rank, index), so each rank computes
// the serial float64 reference of the whole operation by itself. Inputs are small integers
// (multiples of the world size for avg) so every partial sum is exact in the element type:
// results must match the reference exactly, nccl-tests style (#wrong == 0). Outputs are
// poisoned first, so an element the backend never wrote is caught.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "random.hpp"
#include "zp/collective.hpp"

namespace zp::test {

// Largest |partial sum| still exact in T.
template <class T> constexpr double exact_limit() {
  if constexpr (std::is_same_v<T, bf16>) return 256;
  else if constexpr (std::is_same_v<T, fp16>) return 2048;
  else return 1 << 20;
}

// Input element i of rank r: an integer in [-K, K] (times N for avg), K chosen so that the sum
// over N ranks stays exact.
template <class T>
double input(std::uint64_t seed, int rank, std::size_t i, int ranks, ReduceOp op) {
  const double scale = op == ReduceOp::avg ? ranks : 1;
  const auto k = std::int64_t(std::max(1.0, std::floor(exact_limit<T>() / (scale * ranks))));
  const auto h = mix(seed ^ mix(std::uint64_t(rank) * 1000003ull + i));
  return scale * double(std::int64_t(h % std::uint64_t(2 * k + 1)) - k);
}

template <class T> T to(double v) { return T(v); }
template <class T> double from(T v) { return double(v); }
template <> inline bf16 to<bf16>(double v) { return bf16(float(v)); }
template <> inline fp16 to<fp16>(double v) { return fp16(float(v)); }
template <> inline double from<bf16>(bf16 v) { return double(float(v)); }
template <> inline double from<fp16>(fp16 v) { return double(float(v)); }

inline double reduce_ref(ReduceOp op, const std::vector<double>& xs) {
  double acc = xs[0];
  for (std::size_t i = 1; i < xs.size(); ++i) {
    if (op == ReduceOp::max) acc = std::max(acc, xs[i]);
    else if (op == ReduceOp::min) acc = std::min(acc, xs[i]);
    else acc += xs[i];
  }
  return op == ReduceOp::avg ? acc / double(xs.size()) : acc;
}

// Integer avg truncates toward zero like C++ division; inputs are multiples of N so it is exact.
template <class T>
std::vector<T> inputs(std::uint64_t seed, int rank, std::size_t n, int ranks, ReduceOp op) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = to<T>(input<T>(seed, rank, i, ranks, op));
  return v;
}

template <class T>
T poison() { return to<T>(-77777.0 > -exact_limit<T>() ? -77777.0 : -3 * exact_limit<T>()); }

// Counts elements of got[i] != want(i) and describes the first.
template <class T, class F>
std::size_t count_wrong(std::span<const T> got, F&& want, std::string& first) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = want(i), g = from<T>(got[i]);
    if (!(g == w)) {
      if (wrong++ == 0) {
        std::ostringstream os;
        os << "element " << i << ": got " << g << ", expected " << w;
        first = os.str();
      }
    }
  }
  return wrong;
}

template <class T, class B>
void check_all_reduce(Collective<B>& comm, std::uint64_t seed, std::size_t n, ReduceOp op,
                      bool in_place) {
  const int N = comm.size(), r = comm.rank();
  auto in = inputs<T>(seed, r, n, N, op);
  std::vector<T> out(n, poison<T>());
  if (in_place) {
    comm.all_reduce(std::span<T>(in), op);
  } else {
    comm.all_reduce(std::span<const T>(in), std::span<T>(out), op);
  }
  std::span<const T> got = in_place ? std::span<const T>(in) : std::span<const T>(out);
  std::vector<double> xs(static_cast<std::size_t>(N));
  std::string first;
  const auto wrong = count_wrong<T>(got, [&](std::size_t i) {
    for (int q = 0; q < N; ++q) xs[std::size_t(q)] = input<T>(seed, q, i, N, op);
    return from<T>(to<T>(reduce_ref(op, xs)));
  }, first);
  INFO("all_reduce ", name(dtype_of<T>), " n=", n, " op=", name(op), " in_place=", in_place,
       " rank=", r, "/", N, " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
  if (!in_place) {  // the input is untouched
    const auto again = inputs<T>(seed, r, n, N, op);
    CHECK((n == 0 || std::memcmp(in.data(), again.data(), n * sizeof(T)) == 0));
  }
}

template <class T, class B>
void check_reduce_scatter(Collective<B>& comm, std::uint64_t seed, std::size_t n, ReduceOp op,
                          bool in_place) {
  const int N = comm.size(), r = comm.rank();
  auto in = inputs<T>(seed, r, n * std::size_t(N), N, op);
  std::vector<T> out(n, poison<T>());
  std::span<const T> got;
  if (in_place) {
    comm.reduce_scatter(std::span<T>(in), op);
    got = std::span<const T>(in).subspan(std::size_t(r) * n, n);
  } else {
    comm.reduce_scatter(std::span<const T>(in), std::span<T>(out), op);
    got = out;
  }
  std::vector<double> xs(static_cast<std::size_t>(N));
  std::string first;
  const auto wrong = count_wrong<T>(got, [&](std::size_t i) {
    for (int q = 0; q < N; ++q) xs[std::size_t(q)] = input<T>(seed, q, std::size_t(r) * n + i, N, op);
    return from<T>(to<T>(reduce_ref(op, xs)));
  }, first);
  INFO("reduce_scatter ", name(dtype_of<T>), " n=", n, " op=", name(op), " in_place=", in_place,
       " rank=", r, "/", N, " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
}

template <class T, class B>
void check_all_gather(Collective<B>& comm, std::uint64_t seed, std::size_t n, bool in_place) {
  const int N = comm.size(), r = comm.rank();
  const auto mine = inputs<T>(seed, r, n, N, ReduceOp::sum);
  std::vector<T> out(n * std::size_t(N), poison<T>());
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + std::ptrdiff_t(std::size_t(r) * n));
    comm.all_gather(std::span<T>(out));
  } else {
    comm.all_gather(std::span<const T>(mine), std::span<T>(out));
  }
  std::string first;
  const auto wrong = count_wrong<T>(std::span<const T>(out), [&](std::size_t i) {
    return from<T>(to<T>(input<T>(seed, int(i / n), i % n, N, ReduceOp::sum)));
  }, first);
  INFO("all_gather ", name(dtype_of<T>), " n=", n, " in_place=", in_place, " rank=", r, "/", N,
       " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
}

template <class T, class B>
void check_broadcast(Collective<B>& comm, std::uint64_t seed, std::size_t n, int root) {
  const int N = comm.size(), r = comm.rank();
  std::vector<T> buf = r == root ? inputs<T>(seed, root, n, N, ReduceOp::sum)
                                 : std::vector<T>(n, poison<T>());
  comm.broadcast(std::span<T>(buf), root);
  std::string first;
  const auto wrong = count_wrong<T>(std::span<const T>(buf), [&](std::size_t i) {
    return from<T>(to<T>(input<T>(seed, root, i, N, ReduceOp::sum)));
  }, first);
  INFO("broadcast ", name(dtype_of<T>), " n=", n, " root=", root, " rank=", r, "/", N,
       " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
}

// A fresh seed, the same on every rank.
template <class B>
std::uint64_t shared_seed(Collective<B>& comm, std::uint64_t local) {
  std::int64_t s = std::int64_t(local & 0x7fffffffffffull);
  comm.broadcast(std::span<std::int64_t>(&s, 1), 0);
  return std::uint64_t(s);
}

// Every operation x reduce op x in/out-of-place for element type T at one size.
template <class T, class B>
void check_every_operation(Collective<B>& comm, std::uint64_t seed, std::size_t n) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    for (bool in_place : {false, true}) {
      check_all_reduce<T>(comm, seed + 1, n, op, in_place);
      check_reduce_scatter<T>(comm, seed + 2, n, op, in_place);
    }
  }
  for (bool in_place : {false, true}) check_all_gather<T>(comm, seed + 3, n, in_place);
  check_broadcast<T>(comm, seed + 4, n, comm.size() - 1);
  check_broadcast<T>(comm, seed + 5, n, 0);
}

template <class B>
void check_every_type(Collective<B>& comm, std::uint64_t seed, std::size_t n) {
  check_every_operation<float>(comm, seed, n);
  check_every_operation<double>(comm, seed, n);
  check_every_operation<std::int32_t>(comm, seed, n);
  check_every_operation<std::int64_t>(comm, seed, n);
  check_every_operation<bf16>(comm, seed, n);
  check_every_operation<fp16>(comm, seed, n);
}

}  // namespace zp::test
