// Tests of include/zp/backend/nccl.hpp (label gpu). Without a CUDA device the program prints
// why and exits with 77, which ctest reports as a skip. With devices it checks every operation
// and element type against the serial reference (tests/collective_cases.hpp), moving inputs to
// the GPU and results back with cudaMemcpy: on one GPU (world size 1), and on all visible GPUs
// of this process (create_local, one thread per device) when there are several.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "zp/backend/nccl.hpp"

#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "../collective_cases.hpp"

using zp::Collective;
using zp::Errc;
using zp::ReduceOp;
using zp::backend::Nccl;

namespace {

using zp::test::fresh_seed;

template <class T>
struct DeviceBuf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit DeviceBuf(std::size_t count) : n(count) {
    if (n) REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)) == cudaSuccess);
  }
  ~DeviceBuf() {
    if (p) cudaFree(p);
  }
  void put(const std::vector<T>& h) {
    if (n) REQUIRE(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n) REQUIRE(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
  std::span<T> span() { return {p, n}; }
};

// Elements of `got` unequal to want(i); the first is described in the test's log.
template <class T>
std::size_t wrong(const std::vector<T>& got, auto&& want) {
  std::string first;
  const auto w = zp::test::count_wrong(std::span<const T>(got), want, first);
  if (w) MESSAGE(w, " wrong of ", got.size(), ", first: ", first);
  return w;
}

// Every operation for T at n elements, on device buffers; results compared on the host.
template <class T>
void check_device(Collective<Nccl>& comm, std::uint64_t seed, std::size_t n) {
  using namespace zp::test;
  const int N = comm.size(), r = comm.rank();
  std::vector<double> xs(static_cast<std::size_t>(N));
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    // 16-bit sums in NCCL round between steps; the inputs keep every partial sum exact.
    for (bool in_place : {false, true}) {
      DeviceBuf<T> in(n), out(n);
      in.put(inputs<T>(seed, r, n, N, op));
      out.put(std::vector<T>(n, poison<T>()));  // an element never written is caught
      if (in_place)
        comm.all_reduce(in.span(), op);
      else
        comm.all_reduce(std::span<const T>(in.span()), out.span(), op);
      const auto got = (in_place ? in : out).get();
      const auto w = wrong(got, [&](std::size_t i) {
        for (int q = 0; q < N; ++q) xs[std::size_t(q)] = input<T>(seed, q, i, N, op);
        return from<T>(to<T>(reduce_ref(op, xs)));
      });
      INFO("all_reduce ", std::string(zp::name(zp::dtype_of<T>)), " n=", n,
           " op=", std::string(zp::name(op)), " in_place=", in_place);
      CHECK(w == 0);

      DeviceBuf<T> full(n * std::size_t(N)), shard(n);
      full.put(inputs<T>(seed + 1, r, n * std::size_t(N), N, op));
      shard.put(std::vector<T>(n, poison<T>()));
      if (in_place)
        comm.reduce_scatter(full.span(), op);
      else
        comm.reduce_scatter(std::span<const T>(full.span()), shard.span(), op);
      auto res = (in_place ? full : shard).get();
      if (in_place)
        res = std::vector<T>(res.begin() + std::ptrdiff_t(std::size_t(r) * n),
                             res.begin() + std::ptrdiff_t(std::size_t(r + 1) * n));
      const auto w2 = wrong(res, [&](std::size_t i) {
        for (int q = 0; q < N; ++q)
          xs[std::size_t(q)] = input<T>(seed + 1, q, std::size_t(r) * n + i, N, op);
        return from<T>(to<T>(reduce_ref(op, xs)));
      });
      INFO("reduce_scatter in_place=", in_place);
      CHECK(w2 == 0);
    }
  }
  for (bool in_place : {false, true}) {
    const auto mine = inputs<T>(seed + 2, r, n, N, ReduceOp::sum);
    DeviceBuf<T> in(n), out(n * std::size_t(N));
    std::vector<T> init(n * std::size_t(N), poison<T>());
    if (in_place)
      std::copy(mine.begin(), mine.end(), init.begin() + std::ptrdiff_t(std::size_t(r) * n));
    out.put(init);
    in.put(mine);
    if (in_place)
      comm.all_gather(out.span());
    else
      comm.all_gather(std::span<const T>(in.span()), out.span());
    const auto w = wrong(out.get(), [&](std::size_t i) {
      return from<T>(to<T>(input<T>(seed + 2, int(i / n), i % n, N, ReduceOp::sum)));
    });
    INFO("all_gather in_place=", in_place);
    CHECK(w == 0);
  }
  {  // all_to_all (grouped ncclSend/ncclRecv): block q of rank r lands in block r of rank q
    DeviceBuf<T> in(n * std::size_t(N)), out(n * std::size_t(N));
    in.put(inputs<T>(seed + 4, r, n * std::size_t(N), N, ReduceOp::sum));
    out.put(std::vector<T>(n * std::size_t(N), poison<T>()));
    comm.all_to_all(std::span<const T>(in.span()), out.span());
    const auto w = wrong(out.get(), [&](std::size_t i) {
      return from<T>(
          to<T>(input<T>(seed + 4, int(i / n), std::size_t(r) * n + i % n, N, ReduceOp::sum)));
    });
    INFO("all_to_all");
    CHECK(w == 0);
  }
  const int root = N - 1;
  DeviceBuf<T> b(n);
  b.put(r == root ? inputs<T>(seed + 3, root, n, N, ReduceOp::sum)
                  : std::vector<T>(n, poison<T>()));
  comm.broadcast(b.span(), root);
  CHECK(wrong(b.get(), [&](std::size_t i) {
          return from<T>(to<T>(input<T>(seed + 3, root, i, N, ReduceOp::sum)));
        }) == 0);
  comm.barrier();
}

void check_every_type(Collective<Nccl>& comm, std::uint64_t seed, std::size_t n) {
  check_device<float>(comm, seed, n);
  check_device<double>(comm, seed, n);
  check_device<std::int32_t>(comm, seed, n);
  check_device<std::int64_t>(comm, seed, n);
  check_device<zp::bf16>(comm, seed, n);
  check_device<zp::fp16>(comm, seed, n);
}

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Every rank sends to the next one and receives from the previous one (stream order: even
// ranks send first, odd ranks receive first, so no send waits on a recv queued behind it).
void check_device_p2p(Collective<Nccl>& comm, std::uint64_t seed) {
  using namespace zp::test;
  const int N = comm.size(), r = comm.rank(), next = (r + 1) % N, prev = (r + N - 1) % N;
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(4099)}) {
    DeviceBuf<float> out(n), in(n);
    out.put(message<float>(seed, r, next, 0, n));
    auto send = [&] { comm.send(std::span<const float>(out.span()), next); };
    auto recv = [&] { comm.recv(in.span(), prev); };
    if (r % 2 == 0) {
      send();
      recv();
    } else {
      recv();
      send();
    }
    std::string first;
    const auto got = in.get();
    CHECK(wrong_message<float>(std::span<const float>(got), seed, prev, r, 0, first) == 0);
  }
}

}  // namespace

TEST_CASE("every operation and element type on one GPU matches the reference") {
  auto comms = Nccl::create_local({0});
  Collective<Nccl> comm{std::move(comms[0])};
  CHECK(comm.size() == 1);
  CHECK(comm.rank() == 0);
  for (std::size_t n : {0, 1, 7, 1000, 1000003}) check_every_type(comm, fresh_seed(), n);
}

TEST_CASE("async operations complete through their events, and split works") {
  auto comms = Nccl::create_local({0});
  Collective<Nccl> comm{std::move(comms[0])};
  const std::size_t n = 4099;
  const auto seed = fresh_seed();
  DeviceBuf<float> a(n);
  a.put(zp::test::inputs<float>(seed, 0, n, 1, ReduceOp::sum));
  auto w = comm.all_reduce_async(a.span(), ReduceOp::sum);
  auto w2 = comm.all_gather_async(a.span());
  w.wait();
  while (!w2.test()) {
  }
  const auto got = a.get();
  CHECK(wrong(got, [&](std::size_t i) {
          return double(zp::test::input<float>(seed, 0, i, 1, ReduceOp::sum));
        }) == 0);
  auto sub = comm.split(0, 0);
  CHECK(sub.size() == 1);
  check_device<float>(sub, seed, 77);
}

TEST_CASE("bad arguments are errors") {
  auto comms = Nccl::create_local({0});
  Collective<Nccl> comm{std::move(comms[0])};
  DeviceBuf<float> a(8);
  CHECK_THROWS_WITH_AS(comm.broadcast(a.span(), 1), doctest::Contains("root 1"), zp::Error);
  CHECK_THROWS_AS(Nccl::create_local({}), zp::Error);
  // World size 1: the only rank is this one, so every send and recv has a bad peer.
  zp::test::expect_invalid([&] { comm.send(std::span<const float>(a.span()), 0); },
                           {"send: peer 0 is this rank"});
  zp::test::expect_invalid([&] { comm.recv(a.span(), 1); },
                           {"recv: peer 1 is not a rank in [0, 1)"});
}

TEST_CASE("several GPUs in one process, one thread per device") {
  const int devices = device_count();
  if (devices < 2) {
    MESSAGE("skip: only ", devices, " CUDA device(s); the multi-GPU case needs 2 or more");
    return;
  }
  std::vector<int> ids(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) ids[std::size_t(d)] = d;
  auto comms = Nccl::create_local(ids);
  const auto seed = fresh_seed();
  std::vector<std::thread> threads;
  for (auto& b : comms)
    threads.emplace_back([&seed, backend = std::move(b)]() mutable {
      cudaSetDevice(backend.device());
      Collective<Nccl> comm{std::move(backend)};
      for (std::size_t n : {1, 7, 1000}) check_every_type(comm, seed, n);
      check_device_p2p(comm, seed);
    });
  for (auto& t : threads) t.join();
}

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("skip: no CUDA device available (%s); the nccl backend tests need a GPU\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  int version = 0;
  if (ncclGetVersion(&version) == ncclSuccess) std::printf("NCCL %d\n", version);
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
