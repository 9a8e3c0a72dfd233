// zp/backend/cuda_threads.hpp: every collective (all_to_all and all_to_all_v too) on 1-4 ranks sharing one device
// equals the threads backend on the host, bit for bit, on fresh random inputs (f32, f64, bf16,
// fp16, i32; sum, avg, max, min; in place and not), and every output element is written. The same with each
// kind of stream delayed (zp::device::delay_streams). Built with g++ it runs on the simulated
// device (label sim); as cuda_threads.test.cu with nvcc, on a GPU (label gpu; without one it
// exits 77, skip).
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "../device_or_skip.hpp"
#include "../expect_error.hpp"
#include "../random.hpp"
#include "zp/backend/cuda_threads.hpp"
#include "zp/device/memory.hpp"

using zp::Collective;
using zp::CollOp;
using zp::ReduceOp;
using zp::backend::CudaThreads;
using zp::backend::Threads;

namespace {

const int devices =
    zp::test::devices_or_skip("the cuda_threads backend tests");  // before doctest's main

// Input of rank r: n values from the seed (integers for i32, small so sums stay exact).
template <class T>
std::vector<T> input(std::uint64_t seed, int r, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float u = zp::test::hash_uniform(seed + std::uint64_t(r) * 1000003, i);
    if constexpr (std::is_integral_v<T>)
      v[i] = T(u * 1000);
    else
      v[i] = T(u * 8);
  }
  return v;
}

// The operation on one backend: this rank's output as a host vector (poisoned before, unless
// the operation is in place). exchange_v: all_to_all_v, rank r sending (r + 2q) % 3 * n / 2
// elements to rank q and one more to itself (some blocks empty, never a whole buffer).
template <class T, class B>
std::vector<T> run(Collective<B>& comm, CollOp op, ReduceOp rop, std::size_t n, std::uint64_t seed,
                   bool in_place, bool exchange_v = false) {
  const int N = comm.size(), r = comm.rank();
  const bool blocks_in = op == CollOp::reduce_scatter || op == CollOp::all_to_all,
             blocks_out = op == CollOp::all_gather || op == CollOp::all_to_all;
  std::vector<std::size_t> sends(static_cast<std::size_t>(N)), recvs(sends);
  for (int q = 0; q < N; ++q) {
    sends[std::size_t(q)] = std::size_t((r + 2 * q) % 3) * n / 2 + (q == r);
    recvs[std::size_t(q)] = std::size_t((q + 2 * r) % 3) * n / 2 + (q == r);
  }
  const std::vector<T> in = input<T>(seed, r,
                                     exchange_v  ? zp::detail::block_offset(sends.data(), N)
                                     : blocks_in ? n * std::size_t(N)
                                                 : n);
  const std::size_t out_n = exchange_v   ? zp::detail::block_offset(recvs.data(), N)
                            : blocks_out ? n * std::size_t(N)
                                         : n;
  std::vector<T> out(out_n);
  std::memset(out.data(), 0x7f, out.size() * sizeof(T));  // poison: every element must be written
  auto exec = [&](std::span<T> i, std::span<T> o) {
    switch (op) {
      case CollOp::all_reduce:
        in_place ? comm.all_reduce(o, rop) : comm.all_reduce(std::span<const T>(i), o, rop);
        break;
      case CollOp::reduce_scatter: comm.reduce_scatter(std::span<const T>(i), o, rop); break;
      case CollOp::all_gather: comm.all_gather(std::span<const T>(i), o); break;
      case CollOp::all_to_all:
        if (exchange_v)
          comm.all_to_all_v(std::span<const T>(i), std::span<const std::size_t>(sends), o,
                            std::span<const std::size_t>(recvs));
        else
          comm.all_to_all(std::span<const T>(i), o);
        break;
      case CollOp::broadcast: comm.broadcast(o, 1 % N); break;  // in place: o starts as the input
      default: break;
    }
  };
  if (op == CollOp::broadcast) in_place = true;
  if constexpr (B::memory == zp::MemorySpace::host) {
    std::vector<T> i = in;
    if (in_place) out = in;
    exec(i, out);
  } else {
    zp::Buffer<T, zp::MemorySpace::device> di(in.size()), dout(out.size());
    zp::Memory<zp::MemorySpace::device>::from_host(di.span(), std::span<const T>(in));
    zp::Memory<zp::MemorySpace::device>::from_host(dout.span(),
                                                   std::span<const T>(in_place ? in : out));
    exec(di.span(), dout.span());
    zp::Memory<zp::MemorySpace::device>::to_host(std::span<T>(out),
                                                 std::span<const T>(dout.span()));
  }
  return out;
}

template <class T>
void check(int N, CollOp op, ReduceOp rop, std::size_t n, bool in_place, bool exchange_v = false) {
  CAPTURE(N);
  CAPTURE(zp::name(op));
  CAPTURE(zp::name(rop));
  CAPTURE(n);
  CAPTURE(in_place);
  CAPTURE(exchange_v);
  const std::uint64_t seed = zp::test::run_seed("cuda_threads.test") + n;
  std::vector<std::vector<T>> host(static_cast<std::size_t>(N)), dev(static_cast<std::size_t>(N));
  zp::backend::run_threads(N, [&](Collective<Threads>& c) {
    host.at(std::size_t(c.rank())) = run<T>(c, op, rop, n, seed, in_place, exchange_v);
  });
  zp::backend::run_cuda_threads(N, [&](Collective<CudaThreads>& c) {
    dev.at(std::size_t(c.rank())) = run<T>(c, op, rop, n, seed, in_place, exchange_v);
  });
  for (std::size_t r = 0; r < std::size_t(N); ++r) {
    REQUIRE(host.at(r).size() == dev.at(r).size());
    CHECK(std::memcmp(host.at(r).data(), dev.at(r).data(), host.at(r).size() * sizeof(T)) == 0);
  }
}

// Many blocks of a grid-stride launch on a GPU; the simulator's loops are serial (and slower
// still under TSan), so it gets a size that still splits unevenly over the ranks.
#if defined(ZP_DEVICE_SIM)
constexpr std::size_t large = 10007;
#else
constexpr std::size_t large = 100003;
#endif

template <class T>
void every_case() {
  for (int N = 1; N <= 4; ++N)
    for (std::size_t n : {std::size_t(1), std::size_t(1000), large}) {
      for (ReduceOp rop : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        check<T>(N, CollOp::all_reduce, rop, n, false);
        check<T>(N, CollOp::all_reduce, rop, n, true);
        check<T>(N, CollOp::reduce_scatter, rop, n, false);
      }
      check<T>(N, CollOp::all_gather, ReduceOp::sum, n, false);
      check<T>(N, CollOp::all_to_all, ReduceOp::sum, n, false);
      check<T>(N, CollOp::all_to_all, ReduceOp::sum, n, false, true);
      check<T>(N, CollOp::broadcast, ReduceOp::sum, n, false);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda_threads collectives equal the threads backend bit for bit", T, float,
                   double, zp::bf16, zp::fp16, std::int32_t) {
  every_case<T>();
}

// Ordering between the ranks' compute and communication streams, proven by delaying each kind
// in turn (an idle wait before every enqueue there): the results must not change.
TEST_CASE(
    "cuda_threads collectives are unchanged with the communication or compute streams delayed") {
  for (auto role : {zp::device::Role::comm, zp::device::Role::compute}) {
    CAPTURE(int(role));
    zp::device::delay_streams(role,
                              std::chrono::microseconds(100));  // longer than these operations
    for (int N : {2, 3}) {
      check<float>(N, CollOp::all_reduce, ReduceOp::sum, large, true);
      check<zp::bf16>(N, CollOp::reduce_scatter, ReduceOp::avg, large, false);
      check<float>(N, CollOp::all_gather, ReduceOp::sum, large, false);
      check<float>(N, CollOp::all_to_all, ReduceOp::sum, large, false);
      check<float>(N, CollOp::all_to_all, ReduceOp::sum, large, false, true);
      check<float>(N, CollOp::broadcast, ReduceOp::sum, large, false);
    }
    zp::device::delay_streams(role, {});
  }
}

#if defined(ZP_DEVICE_SIM)
// The simulated device refuses a collective on host memory, as nccl does: cuda_threads' kernels
// reach page-locked memory, so without this a gather that skipped its upload (offloaded
// parameters) would pass here and fail on nccl.
TEST_CASE("on the simulated device a cuda_threads collective on host memory is an error") {
  zp::backend::run_cuda_threads(2, [&](Collective<CudaThreads>& comm) {
    zp::Buffer<float, zp::MemorySpace::device> out(4);
    const zp::Buffer<float, zp::MemorySpace::pinned> pinned(2);
    const std::vector<float> pageable(2);
    for (const float* in : {static_cast<const float*>(pinned.data()), pageable.data()})
      zp::test::expect_invalid([&] { comm.all_gather(std::span<const float>(in, 2), out.span()); },
                               {"cuda_threads: a collective's input is in host memory"});
    zp::test::expect_invalid(
        [&] {
          comm.all_gather(std::span<const float>(out.span(0, 2)),
                          std::span<float>(pinned.data(), 2 * 2));
        },
        {"cuda_threads: a collective's output is in host memory"});
  });
}
#endif
