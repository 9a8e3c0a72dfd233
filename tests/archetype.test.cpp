// The front end asks a backend for nothing beyond the Backend concept (zp/collective.hpp): it is
// instantiated here with zp::test::Archetype (archetype_backend.hpp), which has exactly what the
// concept requires. Anything extra the front end used would make this file fail to compile.
#include "archetype_backend.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "zp/backend/threads.hpp"
#include "zp/collective.hpp"
#include "zp/engine.hpp"
#include "zp/grid.hpp"
#include "expect_error.hpp"
#include "zero_mlp.hpp"

using zp::test::Archetype;
using zp::test::archetype_world;

// Every non-template member of the front ends, instantiated against the archetype.
template class zp::Collective<Archetype>;
template class zp::ProcessGrid<Archetype>;
template class zp::Engine<Archetype, float, 0>;
template class zp::Engine<Archetype, float, 1>;
template class zp::Engine<Archetype, float, 2>;
template class zp::Engine<Archetype, float, 3>;
template class zp::Engine<Archetype, zp::bf16, 3>;

namespace {

using Comm = zp::Collective<Archetype>;

template <class T>
std::vector<T> iota(std::size_t n, float first) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = T(first + float(i));
  return v;
}

template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return same_bits(std::span<const T>(a), std::span<const T>(b));
}

}  // namespace

TEST_CASE_TEMPLATE(
    "every member function template of Collective compiles and works against the archetype backend",
    T, float, zp::bf16) {
  Comm comm(archetype_world());
  static_assert(Comm::memory == zp::MemorySpace::host);
  static_assert(std::is_same_v<Comm::backend_type, Archetype>);
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  const Comm& ccomm = comm;
  CHECK(ccomm.backend().size() == 1);
  CHECK(comm.backend().rank() == 0);
  comm.reset_stats();

  const std::size_t n = 37;  // prime
  const std::vector<T> src = iota<T>(n, 1.0f);
  std::vector<T> dst(n, T(0.0f));
  const std::span<const T> in(src);
  const std::span<T> out(dst);

  SUBCASE("all_reduce") {
    for (auto op : {zp::ReduceOp::sum, zp::ReduceOp::avg, zp::ReduceOp::max, zp::ReduceOp::min}) {
      std::fill(dst.begin(), dst.end(), T(0.0f));
      comm.all_reduce(in, out, op);
      CHECK(same_bits(dst, src));
    }
    std::fill(dst.begin(), dst.end(), T(0.0f));
    auto w = comm.all_reduce_async(in, out);
    w.wait();
    CHECK(same_bits(dst, src));
    std::vector<T> io = src;
    comm.all_reduce(std::span<T>(io));
    auto w2 = comm.all_reduce_async(std::span<T>(io), zp::ReduceOp::max);
    CHECK(w2.test());
    CHECK(same_bits(io, src));
    CHECK(comm.stats()[zp::CollOp::all_reduce].calls == 7);
    CHECK(comm.stats()[zp::CollOp::all_reduce].bytes == 7 * n * sizeof(T));
  }
  SUBCASE("reduce_scatter") {
    comm.reduce_scatter(in, out);
    CHECK(same_bits(dst, src));
    std::fill(dst.begin(), dst.end(), T(0.0f));
    {
      auto w = comm.reduce_scatter_async(in, out, zp::ReduceOp::avg);
      CHECK(dst[0] == T(0.0f));  // the archetype completes at wait(), not at issue
    }                            // a Work destroyed without wait() completes its operation
    CHECK(same_bits(dst, src));
    std::vector<T> io = src;
    comm.reduce_scatter(std::span<T>(io));
    comm.reduce_scatter_async(std::span<T>(io), zp::ReduceOp::min).wait();
    CHECK(same_bits(io, src));
    CHECK(comm.stats()[zp::CollOp::reduce_scatter].calls == 4);
  }
  SUBCASE("all_gather") {
    comm.all_gather(in, out);
    CHECK(same_bits(dst, src));
    std::fill(dst.begin(), dst.end(), T(0.0f));
    Comm::Work w = comm.all_gather_async(in, out);
    CHECK(dst[0] == T(0.0f));
    Comm::Work moved = std::move(w);
    w.wait();  // moved from: nothing to wait for
    CHECK(dst[0] == T(0.0f));
    moved.wait();
    CHECK(same_bits(dst, src));
    std::vector<T> io = src;
    comm.all_gather(std::span<T>(io));
    comm.all_gather_async(std::span<T>(io)).wait();
    CHECK(same_bits(io, src));
    CHECK(comm.shard(std::span<T>(io)).size() == n);
    CHECK(comm.shard(std::span<const T>(src)).data() == src.data());
    CHECK(comm.stats()[zp::CollOp::all_gather].calls == 4);
  }
  SUBCASE("broadcast and barrier") {
    std::vector<T> io = src;
    comm.broadcast(std::span<T>(io), 0);
    comm.broadcast_async(std::span<T>(io), 0).wait();
    CHECK(same_bits(io, src));
    comm.barrier();
    CHECK(comm.stats()[zp::CollOp::broadcast].calls == 2);
    CHECK(comm.stats()[zp::CollOp::barrier].calls == 1);
    zp::test::expect_invalid([&] { comm.broadcast(std::span<T>(io), 1); }, {"root 1"});
  }
  SUBCASE("send and recv have no peer in a world of one") {
    std::vector<T> io = src;
    const std::span<T> buf(io);
    zp::test::expect_invalid([&] { comm.send(in, 1); }, {"send", "peer 1"});
    zp::test::expect_invalid([&] { comm.send(buf, 0); }, {"send", "peer 0 is this rank"});
    zp::test::expect_invalid([&] { (void)comm.send_async(in, 1); }, {"send", "peer 1"});
    zp::test::expect_invalid([&] { (void)comm.send_async(buf, 1); }, {"send", "peer 1"});
    zp::test::expect_invalid([&] { comm.recv(buf, 1); }, {"recv", "peer 1"});
    zp::test::expect_invalid([&] { (void)comm.recv_async(buf, 0); },
                             {"recv", "peer 0 is this rank"});
  }
  SUBCASE("split, move, a default Work") {
    Comm sub = comm.split(0, 0);
    CHECK(sub.size() == 1);
    std::vector<T> io = src;
    sub.all_reduce(std::span<T>(io));
    CHECK(sub.stats().total().calls == 1);
    CHECK(comm.stats().total().calls == 0);
    Comm moved(std::move(sub));
    CHECK(moved.stats().total().calls == 1);
    comm = std::move(moved);
    CHECK(comm.stats().total().calls == 1);
    Comm::Work empty;
    CHECK(empty.test());
    empty.wait();
  }
}

namespace {

zp::EngineConfig small_buckets(int gas) {
  zp::EngineConfig c;
  c.batch = {.micro_batch_per_rank = 3, .gradient_accumulation_steps = gas};
  c.bucket_bytes = 4096;
  c.first_bucket_bytes = 512;
  c.align = 4;
  return c;
}

struct Result {
  std::vector<float> params_before, params, master;
  std::int64_t steps = 0;
};

// `steps` optimizer steps of gas micro-steps each on the test MLP, one rank over comm.
template <class B, class T, int Stage>
Result train(zp::Collective<B>& comm, int steps, int gas) {
  zp::test::Mlp<T> model;
  zp::Engine<B, T, Stage> engine(comm, model, small_buckets(gas),
                                 zp::optim::AdamW{.lr = 1e-2f, .eps = 1e-4f});
  Result r;
  for (const T& x : engine.gather_params()) r.params_before.push_back(float(x));
  for (int t = 0; t < steps; ++t)
    for (int i = 0; i < gas; ++i) {
      const auto res = zp::test::micro_step(engine, model, std::int64_t(t * gas + i) * 3, 3);
      CHECK(!res.overflow);
    }
  r.steps = engine.steps();
  for (const T& x : engine.gather_params()) r.params.push_back(float(x));
  r.master = engine.gather_master();
  return r;
}

template <class T, int Stage>
Result train_threads(int steps, int gas) {
  Result r;
  zp::backend::run_threads(1, [&](zp::Collective<zp::backend::Threads>& comm) {
    r = train<zp::backend::Threads, T, Stage>(comm, steps, gas);
  });
  return r;
}

template <class T, int S>
struct Case {
  using type = T;
  static constexpr int stage = S;
};

}  // namespace

TEST_CASE_TEMPLATE(
    "the engine on the archetype backend trains bit for bit like the threads backend at one rank",
    C, Case<float, 0>, Case<float, 1>, Case<float, 2>, Case<float, 3>, Case<zp::bf16, 3>) {
  using T = typename C::type;
  constexpr int S = C::stage;
  const int steps = 3, gas = 2;
  Comm comm(archetype_world());
  const Result a = train<Archetype, T, S>(comm, steps, gas);
  const Result t = train_threads<T, S>(steps, gas);
  CHECK(a.steps == steps);
  REQUIRE(!a.params.empty());
  CHECK(a.params.size() == a.params_before.size());
  std::size_t changed = 0;
  for (std::size_t i = 0; i < a.params.size(); ++i) changed += a.params[i] != a.params_before[i];
  CHECK(changed > a.params.size() / 2);
  CHECK(same_bits(a.params_before, t.params_before));
  CHECK(same_bits(a.params, t.params));
  CHECK(same_bits(a.master, t.master));
  CHECK(comm.stats().total().calls > 0);
}

TEST_CASE("a process grid and an engine over it build on the archetype backend") {
  Comm world(archetype_world());
  zp::ProcessGrid<Archetype> grid(world, {.dp = 1, .tp = 1, .pp = 1});
  CHECK(grid.dp().size() == 1);
  zp::test::Mlp<float> model;
  zp::Engine<Archetype, float, 2> engine(grid, model, small_buckets(1));
  const auto res = zp::test::micro_step(engine, model, 0, 3);
  CHECK(res.boundary);
  CHECK(engine.steps() == 1);
}

// This program links no optional component, zp::aio included: an engine asked to offload to NVMe
// is refused when it is built, saying what to link.
TEST_CASE("without zp::aio, an engine offloading to NVMe is refused naming the component") {
#ifdef ZP_WITH_AIO
  FAIL("built with zp::aio");
#endif
  Comm world(archetype_world());
  zp::test::Mlp<float> model;
  zp::EngineConfig optimizer = small_buckets(1), params = small_buckets(1);
  optimizer.offload_optimizer = true;
  optimizer.optimizer_nvme = zp::NvmeOptions{.path = "/nonexistent/zp-swap"};
  params.offload_optimizer = params.offload_param = true;
  params.optimizer_nvme = params.param_nvme = optimizer.optimizer_nvme;
  for (const zp::EngineConfig& c : {optimizer, params})
    CHECK_THROWS_WITH_AS((zp::Engine<Archetype, float, 3>(world, model, c)),
                         doctest::Contains("this program was built without zp::aio (io_uring); "
                                           "link the zp::aio component"),
                         zp::Error);
}
