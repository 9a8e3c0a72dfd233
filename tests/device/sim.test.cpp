// zp/device/sim.hpp: the simulated device keeps CUDA's stream semantics under its adversarial
// scheduler: a stream runs its work in order, an event wait holds back exactly what CUDA's
// does, a stream-ordered free returns its block only when the stream reaches it, host waits
// and queries see exactly what has run, copies from and to pageable memory behave as CUDA's,
// and failures (a faulting task, a copy past its block, an allocation beyond the memory limit)
// are clear zp::Errors; a task's fault is sticky, as a CUDA context's is.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "../expect_error.hpp"
#include "../random.hpp"
#include "zp/device/memory.hpp"

namespace dev = zp::device;
using namespace std::chrono_literals;

namespace {

// Writes `value` at p[*counter] and advances the counter (one element: one work item).
struct Append {
  int* p;
  int* counter;
  int value;
  void operator()(std::size_t) const { p[(*counter)++] = value; }
};
struct Set {
  int* p;
  int value;
  void operator()(std::size_t i) const { p[i] = value; }
};
struct CopyTo {
  const int* from;
  int* to;
  void operator()(std::size_t i) const { to[i] = from[i]; }
};
struct Fault {
  void operator()(std::size_t i) const {
    if (i == 7) throw std::runtime_error("element 7 is out of range");
  }
};

// A few ints in device memory, allocated on `s`.
struct Ints {
  dev::stream_t s;
  int* p;
  std::size_t n;
  Ints(std::size_t n, dev::stream_t s)
      : s(s), p(static_cast<int*>(dev::allocate(n * sizeof(int), s))), n(n) {}
  ~Ints() { dev::deallocate(p, s, "test"); }
  std::vector<int> read() const {
    std::vector<int> h(n);
    dev::copy(h.data(), p, n * sizeof(int), s);  // into pageable memory: returns after the copy
    return h;
  }
};

struct Seeded {  // every test here under the adversarial scheduler
  Seeded() {
    auto o = zp::device::sim::options_from_env();
    o.max_delay = 200us;
    zp::device::sim::configure(o);
  }
  ~Seeded() { zp::device::sim::configure(zp::device::sim::options_from_env()); }
};

}  // namespace

TEST_CASE_FIXTURE(Seeded,
                  "a stream runs its work in the order it was enqueued, never on the caller") {
  dev::Stream s;
  Ints out(200, s.get()), counter(1, s.get());
  dev::zero(counter.p, sizeof(int), s.get());
  for (int k = 0; k < 200; ++k) dev::launch(s.get(), 1, Append{out.p, counter.p, k});
  std::vector<int> want(200);
  std::iota(want.begin(), want.end(), 0);
  CHECK(out.read() == want);
  CHECK(counter.read() == std::vector<int>{200});

  // Launches run on the stream's worker: the caller returns while a delayed stream has not.
  dev::delay(s.get(), 100ms);
  dev::launch(s.get(), out.n, Set{out.p, -1});
  CHECK_FALSE(dev::stream_done(s.get()));
  dev::synchronize(s.get(), "test");
  CHECK(dev::stream_done(s.get()));
  CHECK(out.read() == std::vector<int>(200, -1));
}

TEST_CASE_FIXTURE(Seeded,
                  "an event wait holds back exactly the work after it, for the record it saw") {
  dev::Stream a, b;
  Ints x(1, a.get()), y(1, b.get());
  dev::launch(a.get(), 1, Set{x.p, 0});
  dev::launch(b.get(), 1, Set{y.p, 0});
  dev::synchronize(a.get(), "test");
  dev::synchronize(b.get(), "test");

  SUBCASE("a wait on an event never recorded holds nothing back") {
    dev::Event never;
    CHECK(dev::event_done(never.get()));
    dev::delay(a.get(), 300ms);  // a is busy; b must not wait for it
    dev::wait(b.get(), never.get(), "test");
    dev::launch(b.get(), 1, Set{y.p, 5});
    dev::synchronize(b.get(), "test");
    CHECK(y.read() == std::vector<int>{5});
    CHECK_FALSE(dev::stream_done(a.get()));
  }
  SUBCASE("a wait sees the record made before it, not a later re-record") {
    dev::Event e;
    dev::delay(a.get(), 100ms);
    dev::launch(a.get(), 1, Set{x.p, 1});
    dev::record(e.get(), a.get(), "test");
    CHECK_FALSE(dev::event_done(e.get()));  // a is still in its delay
    dev::wait(b.get(), e.get(), "test");
    dev::launch(b.get(), 1, CopyTo{x.p, y.p});  // must see x = 1: after the record, not before
    Ints z(1, a.get());  // not x: b may still be reading x (TSan would rightly report it)
    dev::delay(a.get(), 400ms);
    dev::launch(a.get(), 1, Set{z.p, 2});
    dev::record(e.get(), a.get(), "test");  // b's wait already holds the first record
    dev::synchronize(b.get(), "test");
    CHECK(y.read() == std::vector<int>{1});
    CHECK_FALSE(dev::stream_done(a.get()));  // b did not wait for the second record
    CHECK_FALSE(dev::event_done(e.get()));
    dev::synchronize(e.get(), "test");
    CHECK(dev::event_done(e.get()));
    CHECK(z.read() == std::vector<int>{2});
  }
}

TEST_CASE_FIXTURE(Seeded,
                  "a stream-ordered free returns its block only when the stream reaches it") {
  dev::Stream s;
  const std::size_t n = 1000;
  int* a = static_cast<int*>(dev::allocate(n * sizeof(int), s.get()));
  Ints copy(n, s.get());
  dev::launch(s.get(), n, Set{a, 42});
  dev::delay(s.get(), 100ms);
  dev::launch(s.get(), n, CopyTo{a, copy.p});  // reads a long after the host freed it
  dev::deallocate(a, s.get(), "test");
  int* b = static_cast<int*>(dev::allocate(n * sizeof(int), s.get()));
  CHECK(b != a);  // the free has not run yet: the block is not free
  CHECK(copy.read() == std::vector<int>(n, 42));
  int* c = static_cast<int*>(dev::allocate(n * sizeof(int), s.get()));
  CHECK(c == a);  // now it is, and the pool hands it out again
  // A new or reused block holds garbage (NaN bytes), never the old contents or zeros.
  std::vector<int> h(n);
  dev::copy(h.data(), c, n * sizeof(int), s.get());
  CHECK(h == std::vector<int>(n, -1));
  dev::deallocate(b, s.get(), "test");
  dev::deallocate(c, s.get(), "test");
}

TEST_CASE_FIXTURE(
    Seeded,
    "copies from pageable memory read it before returning, into pageable memory finish first") {
  dev::Stream s;
  const std::size_t n = 4096;
  Ints d(n, s.get());
  std::vector<int> src(n, 7);
  dev::delay(s.get(), 50ms);
  dev::copy(d.p, src.data(), n * sizeof(int), s.get());
  std::fill(src.begin(), src.end(), 8);  // the copy already has its own 7s
  CHECK(d.read() == std::vector<int>(n, 7));
  // Pinned memory is not staged: the copy reads it when the stream gets there.
  int* pinned = static_cast<int*>(dev::allocate_pinned(n * sizeof(int)));
  std::fill(pinned, pinned + n, 3);
  dev::copy(d.p, pinned, n * sizeof(int), s.get());
  dev::synchronize(s.get(), "test");
  CHECK(d.read() == std::vector<int>(n, 3));
  dev::deallocate_pinned(pinned);
}

TEST_CASE("a faulting task is a sticky error naming it, at the next call") {
  {
    dev::Stream s;
    dev::launch(s.get(), 100, Fault{});
    zp::test::expect_error(zp::Errc::cuda, [&] { dev::synchronize(s.get(), "test"); },
                           {"simulated device: kernel on stream"});
    zp::test::expect_error(zp::Errc::cuda, [&] { dev::stream_done(s.get()); },
                           {"element 7 is out of range"});
    zp::test::expect_error(zp::Errc::cuda, [&] { dev::Stream other; },
                           {"failed"});  // every later call
  }
  dev::sim::reset();
  dev::Stream s;
  CHECK(dev::stream_done(s.get()));
}

TEST_CASE("copies past their block and allocations past the memory limit are errors naming them") {
  dev::Stream s;
  Ints d(10, s.get());
  std::vector<int> h(11);
  zp::test::expect_error(zp::Errc::cuda,
                         [&] { dev::copy(d.p, h.data(), 11 * sizeof(int), s.get()); },
                         {"copy destination of 44 bytes at offset 0 runs past the end of its "
                          "device block of 40 bytes"});
  zp::test::expect_error(zp::Errc::cuda,
                         [&] { dev::copy(h.data(), d.p + 9, 2 * sizeof(int), s.get()); },
                         {"copy source of 8 bytes at offset 36 runs past the end"});
  dev::synchronize(s.get(), "test");

  auto o = dev::sim::options_from_env();
  o.memory_limit = 1 << 20;
  dev::sim::configure(o);
  {
    dev::StreamScope on(s.get());
    zp::Buffer<float, zp::MemorySpace::device> fits(1000, "fits");
    zp::test::expect_error(
        zp::Errc::out_of_memory,
        [&] { zp::Buffer<float, zp::MemorySpace::device> b(300000, "too big"); },
        {"too big: cannot allocate 300000 elements (1200000 bytes) in device memory"});
  }
  dev::sim::configure(dev::sim::options_from_env());
}

TEST_CASE("DivMod: quotient and remainder as / and % give them, in 32 and 64 bits") {
  const std::uint64_t seed = zp::test::run_seed("zp.test.device.sim");
  struct Range {
    std::size_t limit, d_max;
  };
  // narrow (both fit 32 bits), the limit at the edge, and wide (dividends past 2^32)
  for (const Range g : {Range{1000, 40}, Range{0xFFFFFFFFu, 0xFFFFFFFFu},
                        Range{std::size_t(1) << 40, std::size_t(1) << 20}}) {
    for (std::uint64_t i = 0; i < 2000; ++i) {
      const std::size_t d = 1 + zp::test::mix(seed + 2 * i) % g.d_max;
      const std::size_t e = i < 2 ? g.limit - i : zp::test::mix(seed + 2 * i + 1) % (g.limit + 1);
      const dev::DivMod div(d, g.limit);
      CHECK(div.narrow == (g.limit <= 0xFFFFFFFFu));
      const auto [q, r] = div(e);
      CHECK_MESSAGE((q == e / d && r == e % d), "e ", e, " d ", d);
    }
  }
}

TEST_CASE(
    "batched: every item of every range runs once, as its own functor's item, in one "
    "launch per Batch") {
  const std::uint64_t seed = zp::test::run_seed("zp.test.device.sim");
  struct Mark {  // item i of range `id` writes id * 1000 + i at out[i]
    int* out = nullptr;
    int id = 0;
    void operator()(std::size_t i) const { out[i] = id * 1000 + int(i); }
  };
  constexpr int N = dev::Batch<Mark>::N, ranges = 3 * N;
  std::vector<std::size_t> sizes(ranges), at(ranges);
  std::size_t total = 0;
  int nonempty = 0;  // ranges of no items are left out of the batches
  for (int j = 0; j < ranges; ++j) {
    sizes[std::size_t(j)] = j % 7 == 3 ? 0 : zp::test::mix(seed + std::uint64_t(j)) % 40;
    at[std::size_t(j)] = total;
    total += sizes[std::size_t(j)];
    nonempty += sizes[std::size_t(j)] > 0;
  }
  dev::Stream s;
  Ints out(total, s.get());
  dev::launch(s.get(), total, Set{out.p, -1});
  std::vector<int> ids(ranges);
  std::iota(ids.begin(), ids.end(), 0);
  int launches = 0;
  dev::batched(
      std::span<const int>(ids),
      [&](int j) {
        return std::pair{Mark{out.p + at[std::size_t(j)], j}, sizes[std::size_t(j)]};
      },
      [&](const dev::Batch<Mark>& b) {
        ++launches;
        dev::launch(s.get(), b.items(), b);
      });
  CHECK(launches == (nonempty + N - 1) / N);
  CHECK(launches >= 3);
  const std::vector<int> got = out.read();
  for (int j = 0; j < ranges; ++j)
    for (std::size_t i = 0; i < sizes[std::size_t(j)]; ++i)
      REQUIRE_MESSAGE(got[at[std::size_t(j)] + i] == j * 1000 + int(i), "range ", j, " item ", i);
}

TEST_CASE("the simulator's environment variables take digits in range, nothing else") {
  const char* name = "ZP_SIM_DELAY_US";
  const std::string before = std::getenv(name) ? std::getenv(name) : "";
  for (const char* v : {"-1", "+5", " 5", "5x", "10000001", "99999999999999999999"}) {
    CAPTURE(v);
    ::setenv(name, v, 1);
    zp::test::expect_invalid([] { zp::device::sim::options_from_env(); },
                             {"ZP_SIM_DELAY_US=", v, "is not an integer in [0, 10000000]"});
  }
  ::setenv(name, "10000000", 1);
  CHECK(zp::device::sim::options_from_env().max_delay == 10s);
  if (before.empty())
    ::unsetenv(name);
  else
    ::setenv(name, before.c_str(), 1);
}
