// ZeRO++'s quantization in device memory against the host's, bit for bit, on fresh random inputs:
// quantized_collectives.hpp's pack and unpack (quantize.hpp's work items, launched) give the
// host's records and values (fp32/bf16, int8/int4, blocks of the engine's formats and small ones,
// lengths off the block, blocks of 1e-38 and of zeros; every word written), and qgZ's two-hop
// reduce_scatter on cuda_threads ranks gives the threads backend's sums on every node layout.
// Built with g++ it runs on the simulated device (label sim); as quantize_device.test.cu with
// nvcc, on a GPU (label gpu; without one it exits 77, skip).
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "bit_difference.hpp"
#include "device_or_skip.hpp"
#include "random.hpp"
#include "zp/backend/cuda_threads.hpp"
#include "zp/device/memory.hpp"
#include "zp/engine_config.hpp"
#include "zp/quantized_collectives.hpp"

namespace {

const int devices = zp::test::devices_or_skip("the device quantization tests");

using zp::quant::Bits;
using zp::quant::Format;
using Dev = zp::Memory<zp::MemorySpace::device>;
template <class X>
using DeviceBuffer = zp::Buffer<X, zp::MemorySpace::device>;

template <class X>
DeviceBuffer<X> to_device(const std::vector<X>& h) {
  DeviceBuffer<X> d(h.size());
  Dev::from_host(d.span(), std::span<const X>(h));
  return d;
}
template <class X>
std::vector<X> to_host(const DeviceBuffer<X>& d) {
  std::vector<X> h(d.size());
  Dev::to_host(std::span<X>(h), std::span<const X>(d.span()));
  return h;
}

// Whether a and b hold the same bits; a failure names how many elements differ and the first.
template <class X>
bool same_bits(const std::vector<X>& a, const std::vector<X>& b) {
  REQUIRE(a.size() == b.size());
  const zp::test::BitDifference d = zp::test::bit_difference(a, b);
  if (d.count)
    MESSAGE(d.count, " of ", a.size(), " differ, the first at ", d.first, ": ",
            double(float(a[d.first])), " against ", double(float(b[d.first])));
  return d.count == 0;
}

// n values of blocks of differing magnitude (1e-2 to 1e2, 1e-38: subnormal scales, zeros).
template <class T>
std::vector<T> values(std::uint64_t seed, std::size_t n, std::size_t block) {
  std::vector<T> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t k = i / block;
    const float mag = k % 7 == 5 ? 1e-38f : k % 7 == 3 ? 0.0f : float(1 << (k % 5)) * 0.04f;
    x[i] = T(zp::test::hash_uniform(seed, i) * mag);
  }
  return x;
}

template <class T>
void pack_unpack(const Format& f, std::size_t n, std::uint64_t seed) {
  const std::vector<T> x = values<T>(seed, n, f.block);
  const std::size_t words = zp::quant::record_words(f, n);
  std::vector<std::int32_t> host(words);
  zp::quant::pack(std::span<const T>(x), f, std::span(host));
  const DeviceBuffer<T> dx = to_device(x);
  DeviceBuffer<std::int32_t> drec = to_device(std::vector<std::int32_t>(words, 0x5a5a5a5a));
  zp::quant::pack<zp::MemorySpace::device>(std::span<const T>(dx.span()), f, drec.span());
  CHECK(same_bits(to_host(drec), host));

  // Unpacked into T over poison, and added to fp32 values, from the host's record.
  std::vector<T> out(n);
  zp::quant::unpack(f, std::span<const std::int32_t>(host), std::span(out));
  const DeviceBuffer<std::int32_t> drec_host = to_device(host);
  DeviceBuffer<T> dout = to_device(std::vector<T>(n, T(-7.0f)));
  zp::quant::unpack<false, zp::MemorySpace::device>(
      f, std::span<const std::int32_t>(drec_host.span()), dout.span());
  CHECK(same_bits(to_host(dout), out));
  std::vector<float> acc(n);
  for (std::size_t i = 0; i < n; ++i) acc[i] = zp::test::hash_uniform(seed + 1, i);
  DeviceBuffer<float> dacc = to_device(acc);
  zp::quant::unpack<true>(f, std::span<const std::int32_t>(host), std::span(acc));
  zp::quant::unpack<true, zp::MemorySpace::device>(
      f, std::span<const std::int32_t>(drec_host.span()), dacc.span());
  CHECK(same_bits(to_host(dacc), acc));
}

// Rank r's input: one piece per rank.
template <class T>
std::vector<T> rank_input(std::uint64_t seed, int r, std::size_t n, std::size_t block) {
  return values<T>(seed + 7919 * std::uint64_t(r + 1), n, block);
}

template <class T>
void reduce_scatter(int ranks, int h, const Format& f, std::size_t piece, std::uint64_t seed) {
  const std::size_t n = std::size_t(ranks);
  std::vector<std::vector<float>> want(n), got(n);
  zp::backend::run_threads(ranks, [&](zp::Collective<zp::backend::Threads>& comm) {
    const int r = comm.rank();
    auto node = comm.split(r / h, r % h);
    auto peers = comm.split(r % h, r / h);
    const std::vector<T> in = rank_input<T>(seed, r, std::size_t(ranks) * piece, f.block);
    std::vector<float> out(piece);
    zp::quant::reduce_scatter(node, peers, std::span<const T>(in), std::span(out), f);
    want[std::size_t(r)] = std::move(out);
  });
  zp::backend::run_cuda_threads(ranks, [&](zp::Collective<zp::backend::CudaThreads>& comm) {
    const int r = comm.rank();
    auto node = comm.split(r / h, r % h);
    auto peers = comm.split(r % h, r / h);
    const auto need =
        zp::quant::reduce_scratch(f, std::size_t(ranks), std::size_t(ranks / h), piece);
    DeviceBuffer<std::int32_t> send(need.records), recv(need.records);
    DeviceBuffer<float> partial(need.partial);
    const DeviceBuffer<T> in =
        to_device(rank_input<T>(seed, r, std::size_t(ranks) * piece, f.block));
    DeviceBuffer<float> out = to_device(std::vector<float>(piece, -7.0f));
    zp::quant::reduce_scatter(node, peers, std::span<const T>(in.span()), out.span(), f,
                              send.span(), recv.span(), partial.span());
    got[std::size_t(r)] = to_host(out);
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(same_bits(got[std::size_t(r)], want[std::size_t(r)]));
  }
}

constexpr Format formats[] = {zp::zero_quantized_weights,
                              zp::zero_quantized_gradients,
                              {.bits = Bits::int4, .block = 512},
                              {.bits = Bits::int4, .block = 16},
                              {.bits = Bits::int8, .block = 3}};

}  // namespace

TEST_CASE_TEMPLATE("pack and unpack in device memory give the host's bits", T, float, zp::bf16) {
  const std::uint64_t seed = zp::test::run_seed("quantize_device.test");
  for (const Format& f : formats)
    for (std::size_t n : {std::size_t(1), f.block - 1, 5 * f.block + 1, std::size_t(40009)}) {
      CAPTURE(int(f.bits));
      CAPTURE(f.block);
      CAPTURE(n);
      pack_unpack<T>(f, n, seed + n);
    }
}

TEST_CASE_TEMPLATE("qgZ's reduce_scatter on cuda_threads ranks gives the threads backend's bits", T,
                   float, zp::bf16) {
  const std::uint64_t seed = zp::test::run_seed("quantize_device.test");
  for (const Format& f : {formats[1], formats[3]})
    for (auto [ranks, h] : {std::pair{2, 2}, {2, 1}, {4, 2}, {4, 1}, {4, 4}}) {
      CAPTURE(int(f.bits));
      CAPTURE(ranks);
      CAPTURE(h);
      reduce_scatter<T>(ranks, h, f, 3001, seed);
    }
}
