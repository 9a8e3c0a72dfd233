// zp/device/memory.hpp on the simulated device: the waits that zp's device memory code relies on
// besides the engine's (tests/engine_device.test.cpp): Memory::to_host into page-locked memory (an
// asynchronous copy) returns with the values there; ZeRO-Offload's staging uploads every
// segment's new values and, when it grows or is destroyed, waits for uploads still in flight
// from its page-locked buffers; freeing a page-locked Buffer waits for the stream that uses it.
// Each case delays the stream so that a missing wait shows as
// wrong values, a crash, or an ASan/TSan report (tests/device/mutations.cmake).
#include <doctest/doctest.h>

#include <chrono>
#include <span>
#include <vector>

#include "../random.hpp"
#include "zp/device/memory.hpp"

namespace dev = zp::device;
using Dev = zp::Memory<zp::MemorySpace::device>;
using namespace std::chrono_literals;

namespace {

struct View {  // what OffloadStaging::run reads of a segment
  std::span<const float> grad;
  std::span<float> param;
};

// Segments of n elements in device memory; the host step writes 2 * grad + 1 into the
// parameters, after holding the stream back so the upload that follows is still in flight
// when run() returns.
struct Offloaded {
  zp::Buffer<float, zp::MemorySpace::device> grad, param;
  std::vector<float> host_grad;
  int segments;
  std::size_t n;
  Offloaded(int segments, std::size_t n, std::uint64_t seed)
      : grad(std::size_t(segments) * n),
        param(std::size_t(segments) * n),
        host_grad(grad.size()),
        segments(segments),
        n(n) {
    for (std::size_t i = 0; i < host_grad.size(); ++i)
      host_grad[i] = zp::test::hash_uniform(seed, i);
    Dev::from_host(grad.span(), std::span<const float>(host_grad));
  }
  void run(zp::OffloadStaging<zp::MemorySpace::device>& staging) {
    staging.run(
        segments,
        [&](int s) {
          return View{std::span<const float>(grad.span(std::size_t(s) * n, n)),
                      param.span(std::size_t(s) * n, n)};
        },
        [&](int, const View& v) {
          for (std::size_t i = 0; i < v.param.size(); ++i) v.param[i] = 2 * v.grad[i] + 1;
          dev::delay(dev::current_stream(), 50ms);
        });
  }
  void check() const {
    std::vector<float> got(param.size());
    Dev::to_host(std::span<float>(got), std::span<const float>(param.span()));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i] != 2 * host_grad[i] + 1;
    CHECK_MESSAGE(wrong == 0, wrong, " of ", got.size(), " parameters not uploaded");
  }
};

}  // namespace

TEST_CASE("to_host into page-locked memory returns with the values there") {
  dev::Stream s;
  dev::StreamScope on(s.get());
  const std::size_t n = 1 << 16;
  std::vector<float> want(n);
  for (std::size_t i = 0; i < n; ++i)
    want[i] = zp::test::hash_uniform(zp::test::run_seed("device/memory.test"), i);
  zp::Buffer<float, zp::MemorySpace::device> d(n);
  Dev::from_host(d.span(), std::span<const float>(want));
  float* pinned = static_cast<float*>(dev::allocate_pinned(n * sizeof(float)));
  std::fill(pinned, pinned + n, -1.0f);
  // The copy itself comes late (to_host's first wait for the stream returns at once): without
  // its synchronisation the host reads the -1s.
  dev::delay_streams(dev::Role::compute, 50ms);
  Dev::to_host(std::span<float>(pinned, n), std::span<const float>(d.span()));
  dev::delay_streams(dev::Role::compute, {});
  CHECK(std::vector<float>(pinned, pinned + n) == want);
  dev::synchronize(s.get(), "test");  // so that a missing wait above shows as wrong values only
  dev::deallocate_pinned(pinned);
}

TEST_CASE(
    "offload staging uploads every segment, and waits for its uploads before it grows or is "
    "freed") {
  dev::Stream s;
  dev::StreamScope on(s.get());
  const std::uint64_t seed = zp::test::run_seed("device/memory.test");
  // Large enough that the page-locked buffers are mapped and unmapped on their own: a copy from
  // a freed one faults even without a sanitizer.
  Offloaded small(3, 1 << 15, seed), large(3, 1 << 16, seed + 1);
  {
    zp::OffloadStaging<zp::MemorySpace::device> staging;
    small.run(staging);
    large.run(staging);  // grows the buffers the last upload of `small` still reads
    small.check();
    large.check();
    small.run(staging);  // the last upload is in flight when the staging is destroyed
  }
  small.check();
}

TEST_CASE("freeing a pinned buffer waits for the stream's copies into it") {
  dev::Stream s;
  dev::StreamScope on(s.get());
  const std::size_t n = 1 << 16;  // mapped on its own: a copy into it once freed faults
  zp::Buffer<float, zp::MemorySpace::device> d(n);
  Dev::zero(d.span());
  {
    zp::Buffer<float, zp::MemorySpace::pinned> p(n);
    dev::delay(s.get(), 50ms);
    dev::copy(p.data(), d.data(), n * sizeof(float), s.get());  // in flight at the free
  }
  CHECK(dev::stream_done(s.get()));
}
