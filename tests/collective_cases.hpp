// Backend-independent checks of Collective<B> on host memory, shared by the threads and mpi
// tests. Every rank derives every rank's input from (seed, rank, index), so each rank computes
// the serial float64 reference of the whole operation by itself. Inputs are small integers
// (multiples of the world size for avg) so every partial sum is exact in the element type:
// results must match the reference exactly, nccl-tests style (#wrong == 0). Outputs are
// poisoned first, so an element the backend never wrote is caught.
#pragma once

#include <doctest/doctest.h>

#include <climits>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <cstdint>
#include <cstring>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "zp/collective.hpp"

namespace zp::test {

// Largest |partial sum| still exact in T.
template <class T>
constexpr double exact_limit() {
  if constexpr (std::is_same_v<T, bf16>)
    return 256;
  else if constexpr (std::is_same_v<T, fp16>)
    return 2048;
  else
    return 1 << 20;
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

template <class T>
T to(double v) {
  return T(v);
}
template <class T>
double from(T v) {
  return double(v);
}
template <>
inline bf16 to<bf16>(double v) {
  return bf16(float(v));
}
template <>
inline fp16 to<fp16>(double v) {
  return fp16(float(v));
}
template <>
inline double from<bf16>(bf16 v) {
  return double(float(v));
}
template <>
inline double from<fp16>(fp16 v) {
  return double(float(v));
}

inline double reduce_ref(ReduceOp op, const std::vector<double>& xs) {
  double acc = xs[0];
  for (std::size_t i = 1; i < xs.size(); ++i) {
    if (op == ReduceOp::max)
      acc = std::max(acc, xs[i]);
    else if (op == ReduceOp::min)
      acc = std::min(acc, xs[i]);
    else
      acc += xs[i];
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
T poison() {
  return to<T>(-77777.0 > -exact_limit<T>() ? -77777.0 : -3 * exact_limit<T>());
}

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
  const auto wrong = count_wrong<T>(
      got,
      [&](std::size_t i) {
        for (int q = 0; q < N; ++q) xs[std::size_t(q)] = input<T>(seed, q, i, N, op);
        return from<T>(to<T>(reduce_ref(op, xs)));
      },
      first);
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
  const auto wrong = count_wrong<T>(
      got,
      [&](std::size_t i) {
        for (int q = 0; q < N; ++q)
          xs[std::size_t(q)] = input<T>(seed, q, std::size_t(r) * n + i, N, op);
        return from<T>(to<T>(reduce_ref(op, xs)));
      },
      first);
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
  const auto wrong = count_wrong<T>(
      std::span<const T>(out),
      [&](std::size_t i) {
        return from<T>(to<T>(input<T>(seed, int(i / n), i % n, N, ReduceOp::sum)));
      },
      first);
  INFO("all_gather ", name(dtype_of<T>), " n=", n, " in_place=", in_place, " rank=", r, "/", N,
       " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
}

// Block q of rank r's input (elements r's input index q*n + i) must land in block r of rank q's
// output; the input is untouched; the counters book the full buffer at (N-1)/N on the bus.
template <class T, class B>
void check_all_to_all(Collective<B>& comm, std::uint64_t seed, std::size_t n, bool async) {
  const int N = comm.size(), r = comm.rank();
  const std::size_t full = n * std::size_t(N);
  const auto in = inputs<T>(seed, r, full, N, ReduceOp::sum);
  std::vector<T> out(full, poison<T>());
  const OpStats before = comm.stats()[CollOp::all_to_all];
  if (async)
    comm.all_to_all_async(std::span<const T>(in), std::span<T>(out)).wait();
  else
    comm.all_to_all(std::span<const T>(in), std::span<T>(out));
  std::string first;
  const auto wrong = count_wrong<T>(
      std::span<const T>(out),
      [&](std::size_t i) {  // element i of block q = i / n came from rank q's block r
        return from<T>(
            to<T>(input<T>(seed, int(i / n), std::size_t(r) * n + i % n, N, ReduceOp::sum)));
      },
      first);
  INFO("all_to_all ", name(dtype_of<T>), " n=", n, " async=", async, " rank=", r, "/", N,
       " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
  const auto again = inputs<T>(seed, r, full, N, ReduceOp::sum);
  CHECK((full == 0 || std::memcmp(in.data(), again.data(), full * sizeof(T)) == 0));
  const OpStats& now = comm.stats()[CollOp::all_to_all];
  CHECK(now.calls == before.calls + 1);
  CHECK(now.bytes == before.bytes + full * sizeof(T));
  CHECK(now.bus_bytes - before.bus_bytes ==
        doctest::Approx(double(full * sizeof(T)) * bus_factor(CollOp::all_to_all, N)));
}

// all_to_all_v: rank r sends exchange_count(seed, r, q, n) elements to rank q (0 to 2n, some
// blocks empty), taken from its input packed in rank order; both buffers have slack past their
// counts that must stay untouched. Rank q's block r must be r's elements at r's offset for q.
inline std::size_t exchange_count(std::uint64_t seed, int from, int to, std::size_t n) {
  return n == 0 ? 0
                : std::size_t(mix(seed ^ mix(std::uint64_t(from) * 31u + std::uint64_t(to))) %
                              (2 * n + 1));
}
template <class T, class B>
void check_all_to_all_v(Collective<B>& comm, std::uint64_t seed, std::size_t n, bool async) {
  const int N = comm.size(), r = comm.rank();
  std::vector<std::size_t> sends(static_cast<std::size_t>(N)), recvs(sends);
  for (int q = 0; q < N; ++q) {
    sends[std::size_t(q)] = exchange_count(seed, r, q, n);
    recvs[std::size_t(q)] = exchange_count(seed, q, r, n);
  }
  const std::size_t sent = detail::block_offset(sends.data(), N),
                    received = detail::block_offset(recvs.data(), N), slack = 3;
  const auto in = inputs<T>(seed, r, sent + slack, N, ReduceOp::sum);
  std::vector<T> out(received + slack, poison<T>());
  const OpStats before = comm.stats()[CollOp::all_to_all];
  if (async)
    comm.all_to_all_v_async(std::span<const T>(in), std::span<const std::size_t>(sends),
                            std::span<T>(out), std::span<const std::size_t>(recvs))
        .wait();
  else
    comm.all_to_all_v(std::span<const T>(in), std::span<const std::size_t>(sends),
                      std::span<T>(out), std::span<const std::size_t>(recvs));
  std::vector<double> want(out.size(), from<T>(poison<T>()));
  for (int q = 0, at = 0; q < N; at += int(recvs[std::size_t(q)]), ++q) {
    std::size_t offset = 0;  // where q's block for r starts in q's input
    for (int p = 0; p < r; ++p) offset += exchange_count(seed, q, p, n);
    for (std::size_t i = 0; i < recvs[std::size_t(q)]; ++i)
      want[std::size_t(at) + i] = from<T>(to<T>(input<T>(seed, q, offset + i, N, ReduceOp::sum)));
  }
  std::string first;
  const auto wrong = count_wrong<T>(
      std::span<const T>(out), [&](std::size_t i) { return want[i]; }, first);
  INFO("all_to_all_v ", name(dtype_of<T>), " n=", n, " async=", async, " rank=", r, "/", N,
       " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
  const auto again = inputs<T>(seed, r, sent + slack, N, ReduceOp::sum);
  CHECK(std::memcmp(in.data(), again.data(), in.size() * sizeof(T)) == 0);
  const OpStats& now = comm.stats()[CollOp::all_to_all];
  CHECK(now.calls == before.calls + 1);
  CHECK(now.bytes == before.bytes + sent * sizeof(T));
  CHECK(now.bus_bytes - before.bus_bytes ==
        doctest::Approx(double((sent - sends[std::size_t(r)]) * sizeof(T))));
}

template <class T, class B>
void check_broadcast(Collective<B>& comm, std::uint64_t seed, std::size_t n, int root) {
  const int N = comm.size(), r = comm.rank();
  std::vector<T> buf =
      r == root ? inputs<T>(seed, root, n, N, ReduceOp::sum) : std::vector<T>(n, poison<T>());
  comm.broadcast(std::span<T>(buf), root);
  std::string first;
  const auto wrong = count_wrong<T>(
      std::span<const T>(buf),
      [&](std::size_t i) { return from<T>(to<T>(input<T>(seed, root, i, N, ReduceOp::sum))); },
      first);
  INFO("broadcast ", name(dtype_of<T>), " n=", n, " root=", root, " rank=", r, "/", N,
       " seed=", seed, " first wrong: ", first);
  CHECK(wrong == 0);
}

// A fresh seed, the same on every rank.
template <class B>
std::uint64_t shared_seed(Collective<B>& comm, std::uint64_t local) {
  std::int64_t s = std::int64_t(local & 0x7fffffffffffull);
  comm.broadcast(std::span<std::int64_t>(&s, 1), 0);
  redrawn(local, std::uint64_t(s));  // ZP_TEST_SEED=s repeats it on every rank
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
  for (bool async : {false, true}) {
    check_all_to_all<T>(comm, seed + 6, n, async);
    check_all_to_all_v<T>(comm, seed + 7, n, async);
  }
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

// Argument errors the backend itself must catch (so they are errors on every rank, and the
// communicator stays usable): every rank passes the same bad call, or one rank a bad root.
template <class B>
void check_bad_arguments(Collective<B>& comm) {
  auto& b = comm.backend();
  const int N = comm.size(), r = comm.rank();
  std::vector<float> buf(std::size_t(N) * 8 + 1, 1.0f);
  float* p = buf.data();
  const auto blocking = Launch::blocking;
  // Overlapping but not identical: all_reduce shifted by one element, a misplaced all_gather
  // input and reduce_scatter output (in place is rank * count, here off by one element).
  expect_invalid([&] { b.all_reduce(p, p + 1, 8, DType::f32, ReduceOp::sum, blocking).wait(); },
                 {"all_reduce: the input and output buffers overlap", "4 bytes apart"});
  expect_invalid(
      [&] { b.all_gather(p + std::size_t(r) * 8 + 1, p, 8, DType::f32, blocking).wait(); },
      {"all_gather: the input overlaps the output but is not this rank's shard"});
  expect_invalid(
      [&] {
        b.reduce_scatter(p, p + std::size_t(r) * 8 + 1, 8, DType::f32, ReduceOp::sum, blocking)
            .wait();
      },
      {"reduce_scatter: the output overlaps the input but is not this rank's shard"});
  // all_to_all is never in place, not even into the same buffer.
  expect_invalid([&] { b.all_to_all(p, p, 1, DType::f32, blocking).wait(); },
                 {"all_to_all: the input and output buffers overlap", "never in place"});
  // The front end: both buffers hold size() equal blocks.
  std::vector<float> odd(std::size_t(N) * 2 + 1), even(std::size_t(N) * 2);
  expect_invalid([&] { comm.all_to_all(std::span<const float>(odd), std::span<float>(even)); },
                 {"all_to_all: input has", "equal blocks (one per rank)"});
  expect_invalid(
      [&] { comm.all_to_all(std::span<const float>(even), std::span<float>(buf).first(1)); },
      {"all_to_all: input has"});
  // all_to_all_v: overlapping buffers, null counts, and one rank's send count that its receiver
  // does not expect (an error on every rank, and the communicator still usable).
  std::vector<std::size_t> ones(std::size_t(N), 1), more(ones);
  more[0] = r == N - 1 ? 2 : 1;
  expect_invalid(
      [&] { b.all_to_all_v(p, more.data(), p + 1, more.data(), DType::f32, blocking).wait(); },
      {"all_to_all_v: the input and output buffers overlap", "never in place"});
  expect_invalid(
      [&] { b.all_to_all_v(p, nullptr, even.data(), ones.data(), DType::f32, blocking).wait(); },
      {"all_to_all_v: the send counts are null"});
  expect_invalid(
      [&] { b.all_to_all_v(p, ones.data(), even.data(), ones.data(), DType(17), blocking).wait(); },
      {"all_to_all_v: element type DType(17) is not one of"});
  const std::string sends = "sends " + std::to_string(N * 4) + " bytes";
  expect_invalid(
      [&] {
        b.all_to_all_v(nullptr, ones.data(), even.data(), ones.data(), DType::f32, blocking).wait();
      },
      {"all_to_all_v: the input buffer is null but", sends.c_str()});
  expect_invalid(
      [&] { b.all_to_all_v(p, ones.data(), nullptr, ones.data(), DType::f32, blocking).wait(); },
      {"all_to_all_v: the output buffer is null but receives"});
  // Counts whose bytes pass 2^64 (rank 0's alone, 2^62 + 1 floats) are refused, not wrapped.
  std::vector<std::size_t> huge(std::size_t(N), (std::size_t(1) << 62) + 1);
  expect_invalid(
      [&] {
        b.all_to_all_v(p, ones.data(), even.data(), huge.data(), DType::f32, blocking).wait();
      },
      {"all_to_all_v: the receive counts up to rank 0 (4611686018427387905 elements there) "
       "overflow a 64-bit size of f32"});
  const auto mismatched = [&] {
    comm.all_to_all_v(std::span<const float>(buf), std::span<const std::size_t>(more),
                      std::span<float>(even), std::span<const std::size_t>(ones));
  };
  if (r == 0)  // the receiver names the pair on every backend
    expect_invalid(mismatched, {"all_to_all_v: rank",
                                " sends 2 elements to rank 0 but rank 0's "
                                "receive count for rank"});
  else
    expect_invalid(mismatched, {"all_to_all_v"});
  expect_invalid(
      [&] {
        comm.all_to_all_v(std::span<const float>(buf).first(0), std::span<const std::size_t>(ones),
                          std::span<float>(even), std::span<const std::size_t>(ones));
      },
      {"all_to_all_v: the send counts add up to"});
  // A null buffer with a nonzero count (an unbound view), unknown reduction and element type.
  expect_invalid([&] { b.all_reduce(nullptr, p, 5, DType::f32, ReduceOp::sum, blocking).wait(); },
                 {"all_reduce: the input buffer is null but count is 5"});
  expect_invalid([&] { b.all_gather(p, nullptr, 3, DType::f32, blocking).wait(); },
                 {"all_gather: the output buffer is null but count is 3"});
  expect_invalid([&] { b.all_reduce(p, p, 4, DType::f32, ReduceOp(9), blocking).wait(); },
                 {"reduction ReduceOp(9) is not one of"});
  expect_invalid([&] { b.all_reduce(p, p, 4, DType(17), ReduceOp::sum, blocking).wait(); },
                 {"element type DType(17) is not one of"});
  expect_invalid(
      [&] { b.all_reduce(p, p, std::size_t(1) << 62, DType::f64, ReduceOp::sum, blocking).wait(); },
      {"count 4611686018427387904"});
  // A bad root on one rank only: every rank gets an error that names it.
  const std::string bad_root = "root" + std::string(N > 1 ? "=" : " ") + std::to_string(N + 3);
  expect_invalid([&] { comm.broadcast(std::span<float>(buf), r == N - 1 ? N + 3 : 0); },
                 {bad_root.c_str()});
  // Still usable: a well-formed call after all of the above.
  std::int64_t x = r + 1;
  comm.all_reduce(std::span<std::int64_t>(&x, 1));
  CHECK(x == std::int64_t(N) * (N + 1) / 2);
}

// Integer sums wrap around (two's complement) instead of being undefined behaviour.
template <class B>
void check_integer_wraparound(Collective<B>& comm) {
  const int N = comm.size();
  std::int32_t a[2] = {INT32_MAX, INT32_MIN + comm.rank()};
  std::int64_t c[1] = {INT64_MAX};
  comm.all_reduce(std::span<std::int32_t>(a));
  comm.all_reduce(std::span<std::int64_t>(c));
  std::uint32_t want0 = 0, want1 = 0;
  std::uint64_t want2 = 0;
  for (int q = 0; q < N; ++q) {
    want0 += std::uint32_t(INT32_MAX);
    want1 += std::uint32_t(INT32_MIN) + std::uint32_t(q);
    want2 += std::uint64_t(INT64_MAX);
  }
  CHECK(a[0] == std::int32_t(want0));
  CHECK(a[1] == std::int32_t(want1));
  CHECK(c[0] == std::int64_t(want2));
}

// A Work dropped without wait() completes its operation first: the results are in place when
// the handle is gone, and the buffer may be freed at once (ASan sees any late write).
template <class B>
void check_dropped_work(Collective<B>& comm, std::uint64_t seed, int rounds) {
  const int N = comm.size(), r = comm.rank();
  for (int k = 0; k < rounds; ++k) {
    const std::size_t n = 1000 + std::size_t(k);
    auto in = std::make_unique<std::vector<float>>(inputs<float>(seed + k, r, n, N, ReduceOp::sum));
    auto mine = std::make_unique<std::vector<float>>(*in);  // both ops in flight: separate inputs
    auto out = std::make_unique<std::vector<float>>(std::size_t(N) * n, -1.0f);
    {
      auto w1 = comm.all_reduce_async(std::span<float>(*in));
      auto w2 = comm.all_gather_async(std::span<const float>(*mine), std::span<float>(*out));
    }  // both handles dropped
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double want = 0;
      for (int q = 0; q < N; ++q) {
        const double x = input<float>(seed + k, q, i, N, ReduceOp::sum);
        want += x;
        wrong += (*out)[std::size_t(q) * n + i] != float(x);
      }
      wrong += (*in)[i] != float(want);
    }
    CHECK(wrong == 0);
    mine.reset();
    in.reset();
    out.reset();
  }
}

// --- send / recv ---------------------------------------------------------------------------
// Message k from rank `src` to rank `dst`: every element derived from (seed, src, dst, k, i),
// so the receiver computes what the sender sent without being told.
template <class T>
std::vector<T> message(std::uint64_t seed, int src, int dst, int k, std::size_t n) {
  const std::uint64_t s = seed ^ mix(std::uint64_t(src) * 7919u + std::uint64_t(dst) * 104729u +
                                     std::uint64_t(k) * 1299709u);
  return inputs<T>(s, src, n, 2, ReduceOp::sum);
}

// Elements of got that differ from message k from src to dst (describing the first).
template <class T>
std::size_t wrong_message(std::span<const T> got, std::uint64_t seed, int src, int dst, int k,
                          std::string& first) {
  const auto want = message<T>(seed, src, dst, k, got.size());
  return count_wrong<T>(
      got, [&](std::size_t i) { return from<T>(want[i]); }, first);
}

// A ring: every rank sends to rank + 1 and receives from rank - 1, both async (so the ranks do
// not need to agree on who goes first), the receive polled with test() to its end. Counts in
// the stats as one send and one recv of n.
template <class T, class B>
void check_ring(Collective<B>& comm, std::uint64_t seed, std::size_t n, int k = 0) {
  const int N = comm.size(), r = comm.rank(), next = (r + 1) % N, prev = (r + N - 1) % N;
  const auto out = message<T>(seed, r, next, k, n);
  std::vector<T> in(n, poison<T>());
  const auto before_send = comm.stats()[CollOp::send], before_recv = comm.stats()[CollOp::recv];
  auto ws = comm.send_async(std::span<const T>(out), next);
  auto wr = comm.recv_async(std::span<T>(in), prev);
  while (!wr.test()) std::this_thread::yield();  // polled, as a trainer overlapping it would
  CHECK(wr.test());                              // and done it stays
  ws.wait();
  std::string first;
  const auto wrong = wrong_message<T>(std::span<const T>(in), seed, prev, r, k, first);
  INFO("ring ", name(dtype_of<T>), " n=", n, " rank=", r, "/", N, " seed=", seed,
       " first wrong: ", first);
  CHECK(wrong == 0);
  const auto& s = comm.stats();
  CHECK(s[CollOp::send].calls - before_send.calls == 1);
  CHECK(s[CollOp::send].bytes - before_send.bytes == n * sizeof(T));
  CHECK(s[CollOp::send].bus_bytes - before_send.bus_bytes ==
        doctest::Approx(double(n * sizeof(T))));
  CHECK(s[CollOp::recv].bytes - before_recv.bytes == n * sizeof(T));
}

// Ranks 2i and 2i+1 exchange both ways: blocking send first on the lower rank while the upper
// one receives first; then both send_async before a blocking recv (neither may wait for the
// other's send to finish first); then both blocking recv with the sends async.
template <class T, class B>
void check_pair_exchange(Collective<B>& comm, std::uint64_t seed, std::size_t n) {
  const int N = comm.size(), r = comm.rank(), peer = r ^ 1;
  if (peer >= N) return;
  const bool lower = r < peer;
  std::string first;
  for (int k = 0; k < 3; ++k) {
    const auto out = message<T>(seed, r, peer, k, n);
    std::vector<T> in(n, poison<T>());
    if (k == 0) {
      if (lower) {
        comm.send(std::span<const T>(out), peer);
        comm.recv(std::span<T>(in), peer);
      } else {
        comm.recv(std::span<T>(in), peer);
        comm.send(std::span<const T>(out), peer);
      }
    } else if (k == 1) {
      auto w = comm.send_async(std::span<const T>(out), peer);
      comm.recv(std::span<T>(in), peer);
      w.wait();
    } else {
      auto wr = comm.recv_async(std::span<T>(in), peer);
      auto ws = comm.send_async(std::span<const T>(out), peer);
      ws.wait();  // in the opposite order of the ring: completion must not depend on it
      wr.wait();
    }
    INFO("pair exchange ", name(dtype_of<T>), " step ", k, " n=", n, " rank=", r, " seed=", seed);
    CHECK(wrong_message<T>(std::span<const T>(in), seed, peer, r, k, first) == 0);
  }
}

// Rank 0 sends rank 1 a burst of messages of different sizes (some async, some blocking,
// including empty ones); rank 1 receives them in order, mixing async and blocking too.
template <class B>
void check_message_order(Collective<B>& comm, std::uint64_t seed) {
  const int r = comm.rank();
  if (r > 1) return;
  constexpr int K = 12;
  auto size_of_msg = [&](int k) {
    return k % 4 == 3 ? std::size_t(0) : std::size_t(mix(seed + std::uint64_t(k)) % 3000);
  };
  if (r == 0) {
    std::vector<std::vector<double>> out;
    for (int k = 0; k < K; ++k) out.push_back(message<double>(seed, 0, 1, k, size_of_msg(k)));
    std::vector<typename Collective<B>::Work> works;
    for (int k = 0; k < K; ++k) {
      if (k % 3 == 1)
        comm.send(std::span<const double>(out[std::size_t(k)]), 1);
      else
        works.push_back(comm.send_async(std::span<const double>(out[std::size_t(k)]), 1));
    }
    for (auto& w : works) w.wait();
  } else {
    std::vector<std::vector<double>> in;
    for (int k = 0; k < K; ++k) in.emplace_back(size_of_msg(k), poison<double>());
    std::vector<typename Collective<B>::Work> works;
    for (int k = 0; k < K; ++k) {
      if (k % 2 == 0)
        comm.recv(std::span<double>(in[std::size_t(k)]), 0);
      else
        works.push_back(comm.recv_async(std::span<double>(in[std::size_t(k)]), 0));
    }
    for (auto& w : works) w.wait();
    std::string first;
    for (int k = 0; k < K; ++k) {
      INFO("message ", k, " of ", K, " (", in[std::size_t(k)].size(), " elements) seed=", seed);
      CHECK(wrong_message<double>(std::span<const double>(in[std::size_t(k)]), seed, 0, 1, k,
                                  first) == 0);
    }
  }
}

// The point-to-point cases every backend passes (world size >= 2): rings over every element
// type at sizes 0, 1, primes and random ones, pair exchanges in every order, a burst of messages
// between one pair in order, and empty messages with null buffers.
template <class B>
void check_point_to_point(Collective<B>& comm, std::uint64_t seed) {
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(1031)}) {
    check_ring<float>(comm, seed + 1, n);
    check_ring<double>(comm, seed + 2, n);
    check_ring<std::int32_t>(comm, seed + 3, n);
    check_ring<std::int64_t>(comm, seed + 4, n);
    check_ring<bf16>(comm, seed + 5, n);
    check_ring<fp16>(comm, seed + 6, n);
  }
  for (int k = 0; k < 6; ++k) {  // random sizes (the same on every rank: they derive from seed)
    const std::size_t n = std::size_t(mix(seed * 31 + std::uint64_t(k)) % 20000);
    check_ring<float>(comm, seed + 10 + std::uint64_t(k), n, k);
  }
  for (std::size_t n : {std::size_t(0), std::size_t(5), std::size_t(4099)}) {
    check_pair_exchange<float>(comm, seed + 20, n);
    check_pair_exchange<bf16>(comm, seed + 21, n);
  }
  check_message_order(comm, seed + 30);
  // Empty messages from unbound spans (a null pointer with count 0 is well-formed).
  const int N = comm.size(), r = comm.rank();
  auto ws = comm.send_async(std::span<const std::int32_t>(), (r + 1) % N);
  comm.recv(std::span<std::int32_t>(), (r + N - 1) % N);
  ws.wait();
}

// Mistakes: a bad peer or buffer is an error on the calling rank alone; a count or type
// mismatch between rank 0's send and rank 1's recv is an error on both, naming both calls, and
// leaves the pair usable (the receive buffer's contents are then backend-specific).
template <class B>
void check_point_to_point_errors(Collective<B>& comm) {
  const int N = comm.size(), r = comm.rank();
  std::vector<float> buf(8, 1.0f);
  const std::string out_of_range =
      "peer " + std::to_string(N) + " is not a rank in [0, " + std::to_string(N) + ")";
  expect_invalid([&] { comm.send(std::span<const float>(buf), N); }, {"send: " + out_of_range});
  expect_invalid([&] { comm.recv(std::span<float>(buf), -1); }, {"recv: peer -1 is not a rank"});
  expect_invalid([&] { comm.send_async(std::span<const float>(buf), r).wait(); },
                 {"send: peer " + std::to_string(r) + " is this rank"});
  expect_invalid([&] { comm.recv_async(std::span<float>(buf), r).wait(); },
                 {"recv: peer " + std::to_string(r) + " is this rank"});
  auto& b = comm.backend();
  expect_invalid([&] { b.send(nullptr, 5, DType::f32, (r + 1) % N, Launch::blocking).wait(); },
                 {"send: the buffer is null but count is 5"});
  expect_invalid([&] { b.recv(buf.data(), 4, DType(17), (r + 1) % N, Launch::blocking).wait(); },
                 {"element type DType(17)"});
  if (r <= 1) {
    // Count mismatch, blocking on both sides.
    std::vector<float> five(5, 2.0f), four(4, -1.0f);
    expect_invalid(
        [&] {
          if (r == 0)
            comm.send(std::span<const float>(five), 1);
          else
            comm.recv(std::span<float>(four), 0);
        },
        {"mismatched send/recv", "rank 0 called send(count=5, dtype=f32",
         "rank 1 called recv(count=4, dtype=f32"});
    // Type mismatch, async on both sides.
    std::vector<std::int32_t> ints(4, 7);
    expect_invalid(
        [&] {
          if (r == 0)
            comm.send_async(std::span<const std::int32_t>(ints), 1).wait();
          else
            comm.recv_async(std::span<float>(four), 0).wait();
        },
        {"mismatched send/recv", "send(count=4, dtype=i32", "recv(count=4, dtype=f32"});
    // Still usable: the next message pairs up.
    std::vector<std::int64_t> x(3, r == 0 ? 42 : 0);
    if (r == 0)
      comm.send(std::span<const std::int64_t>(x), 1);
    else
      comm.recv(std::span<std::int64_t>(x), 0);
    CHECK(x[2] == 42);
  }
}

// A dropped async send or recv completes before its handle is gone: the receiver's data is in
// place and both buffers may be freed at once (ASan sees any late access).
template <class B>
void check_dropped_p2p_work(Collective<B>& comm, std::uint64_t seed, int rounds) {
  const int N = comm.size(), r = comm.rank(), next = (r + 1) % N, prev = (r + N - 1) % N;
  for (int k = 0; k < rounds; ++k) {
    const std::size_t n = 500 + std::size_t(k) * 37;
    auto out = std::make_unique<std::vector<float>>(message<float>(seed, r, next, k, n));
    auto in = std::make_unique<std::vector<float>>(n, poison<float>());
    {
      auto ws = comm.send_async(std::span<const float>(*out), next);
      auto wr = comm.recv_async(std::span<float>(*in), prev);
    }  // both handles dropped
    out.reset();
    std::string first;
    CHECK(wrong_message<float>(std::span<const float>(*in), seed, prev, r, k, first) == 0);
    in.reset();
  }
}

}  // namespace zp::test
