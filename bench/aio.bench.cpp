// zp_bench_aio: zp::aio (io_uring, and its threads engine) against a plain synchronous loop over
// the same file, all with O_DIRECT where the file system allows it, measured in the same run.
//
// aio/<write|read>/depth:D/block:B  a 1 GiB transfer (ZP_BENCH_AIO_BYTES overrides) through one
//   File with queue depth D and requests of B bytes; GBps = bytes / time (mean over the
//   iterations); vs_sync = its GBps over the sync row's at the same block size; direct = 1 where
//   O_DIRECT was in effect.
// sync/<write|read>/block:B  the baseline: pwrite/pread of B bytes at a time, one in flight.
// threads/<write|read>/depth:D/block:B  the aio row through the threads engine (what runs where
//   io_uring is refused); vs_io_uring = its GBps over the aio row's of the same D and B.
// <aio|threads>/read_behind_compute/depth:D/block:B  the same read started, then the caller busy
//   for as long as the read alone took just before (io_ms; a spin on the clock, no memory
//   traffic), then waiting for it: total_ms; hidden = (io + compute - total) / min(io, compute),
//   the part of the read that ran while the caller computed (1: all of it; a transfer that moves
//   only while waited for gives 0). What the swap's read-ahead (swap.hpp) relies on.
// The file lives in ZP_BENCH_AIO_DIR (default: the temporary directory): put it on the NVMe
// device to measure. Every read row first checks the bytes against what was written.
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include "zp/async_file.hpp"

namespace {

namespace fs = std::filesystem;
using zp::aio::AlignedBuffer;

std::size_t total_bytes() {
  const char* v = std::getenv("ZP_BENCH_AIO_BYTES");
  const std::size_t b = v ? std::size_t(std::strtoull(v, nullptr, 10)) : std::size_t(1) << 30;
  return std::max<std::size_t>(b / (1 << 20), 1) << 20;  // whole MiB
}

fs::path bench_file() {
  const char* d = std::getenv("ZP_BENCH_AIO_DIR");
  return fs::path(d ? d : fs::temp_directory_path().string()) /
         ("zp_bench_aio." + std::to_string(::getpid()));
}

// The data every row writes (random, so nothing compresses), and reads back.
const AlignedBuffer& data() {
  static const AlignedBuffer b = [] {
    AlignedBuffer a(total_bytes());
    std::mt19937_64 rng(12345);
    auto* w = reinterpret_cast<std::uint64_t*>(a.span().data());
    for (std::size_t i = 0; i < a.span().size() / 8; ++i) w[i] = rng();
    return a;
  }();
  return b;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// GB/s of the sync rows, by (write, block), for vs_sync.
std::map<std::pair<bool, std::size_t>, double>& sync_gbps() {
  static std::map<std::pair<bool, std::size_t>, double> m;
  return m;
}
// GB/s of the io_uring rows, by (write, depth, block), for vs_io_uring.
std::map<std::tuple<bool, unsigned, std::size_t>, double>& uring_gbps() {
  static std::map<std::tuple<bool, unsigned, std::size_t>, double> m;
  return m;
}

void sync_loop(benchmark::State& state, bool write) {
  const std::size_t block = std::size_t(state.range(0)), n = total_bytes();
  const fs::path path = bench_file();
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return state.SkipWithError(("cannot open " + path.string()).c_str());
  AlignedBuffer in(n);
  const auto& d = data();
  for (std::size_t at = 0; !write && at < n; at += block)  // a file to read
    if (::pwrite(fd, d.span().data() + at, block, off_t(at)) != ssize_t(block))
      return state.SkipWithError("pwrite failed");
  double secs = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t at = 0; at < n; at += block) {
      const ssize_t r = write ? ::pwrite(fd, d.span().data() + at, block, off_t(at))
                              : ::pread(fd, in.span().data() + at, block, off_t(at));
      if (r != ssize_t(block)) return state.SkipWithError("short pread/pwrite");
    }
    if (write) ::fdatasync(fd);
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    secs += t;
  }
  ::close(fd);
  fs::remove(path);
  if (!write && std::memcmp(in.span().data(), d.span().data(), n) != 0)
    return state.SkipWithError("the bytes read back differ");
  const double gbps = double(n) * double(state.iterations()) / secs / 1e9;
  sync_gbps()[{write, block}] = gbps;
  state.counters["GBps"] = gbps;
}

void aio_loop(benchmark::State& state, bool write, zp::aio::Engine engine) {
  const unsigned depth = unsigned(state.range(0));
  const std::size_t block = std::size_t(state.range(1)), n = total_bytes();
  const fs::path path = bench_file();
  double secs = 0;
  bool direct = false;
  try {
    zp::aio::File f(path, zp::aio::Mode::read_write,
                    {.queue_depth = depth, .block_bytes = block, .engine = engine});
    direct = f.direct();
    AlignedBuffer in(n);
    if (!write) f.write(data().span(), 0);
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      if (write) {
        f.write(data().span(), 0);
        f.sync();  // as the sync row: the bytes on the device, not in its cache
      } else {
        f.read(in.span(), 0);
      }
      const double t = seconds_since(t0);
      state.SetIterationTime(t);
      secs += t;
    }
    if (!write && std::memcmp(in.span().data(), data().span().data(), n) != 0)
      return state.SkipWithError("the bytes read back differ");
  } catch (const std::exception& e) {
    fs::remove(path);
    return state.SkipWithError(e.what());
  }
  fs::remove(path);
  const double gbps = double(n) * double(state.iterations()) / secs / 1e9;
  state.counters["GBps"] = gbps;
  state.counters["direct"] = direct;
  if (auto it = sync_gbps().find({write, block}); it != sync_gbps().end())
    state.counters["vs_sync"] = gbps / it->second;
  if (engine == zp::aio::Engine::io_uring)
    uring_gbps()[{write, depth, block}] = gbps;
  else if (auto it = uring_gbps().find({write, depth, block}); it != uring_gbps().end())
    state.counters["vs_io_uring"] = gbps / it->second;
}

void read_behind_compute(benchmark::State& state, zp::aio::Engine engine) {
  const unsigned depth = unsigned(state.range(0));
  const std::size_t block = std::size_t(state.range(1)), n = total_bytes();
  const fs::path path = bench_file();
  double io = 0, compute = 0, total = 0;
  try {
    zp::aio::File f(path, zp::aio::Mode::read_write,
                    {.queue_depth = depth, .block_bytes = block, .engine = engine});
    AlignedBuffer in(n);
    f.write(data().span(), 0);
    for (auto _ : state) {
      auto t0 = std::chrono::steady_clock::now();
      f.read(in.span(), 0);
      const double alone = seconds_since(t0);
      std::memset(in.span().data(), 0, n);  // every byte must come again
      t0 = std::chrono::steady_clock::now();
      const zp::aio::Transfer t = f.read_async(in.span(), 0);
      double busy = 0;
      while ((busy = seconds_since(t0)) < alone) {
      }
      f.wait(t);
      const double both = seconds_since(t0);
      state.SetIterationTime(both);
      io += alone, compute += busy, total += both;
      if (std::memcmp(in.span().data(), data().span().data(), n) != 0)
        return state.SkipWithError("the bytes read back differ");
    }
  } catch (const std::exception& e) {
    fs::remove(path);
    return state.SkipWithError(e.what());
  }
  fs::remove(path);
  const double k = 1e3 / double(state.iterations());
  state.counters["io_ms"] = io * k;
  state.counters["compute_ms"] = compute * k;
  state.counters["total_ms"] = total * k;
  state.counters["hidden"] = std::max(0.0, (io + compute - total) / std::min(io, compute));
}

const bool registered = [] {
  // The io_uring rows first: the threads rows' vs_io_uring divides by theirs.
  const zp::aio::Engine engines[] = {zp::aio::Engine::io_uring, zp::aio::Engine::threads};
  const auto prefix = [](zp::aio::Engine e) {
    return std::string(e == zp::aio::Engine::io_uring ? "aio/" : "threads/");
  };
  for (bool write : {true, false}) {
    const std::string op = write ? "write" : "read";
    for (std::int64_t block : {std::int64_t(1) << 20})
      benchmark::RegisterBenchmark(("sync/" + op).c_str(),
                                   [=](benchmark::State& s) { sync_loop(s, write); })
          ->Arg(block)
          ->ArgName("block")
          ->Iterations(3)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    for (const auto engine : engines)
      benchmark::RegisterBenchmark((prefix(engine) + op).c_str(),
                                   [=](benchmark::State& s) { aio_loop(s, write, engine); })
          ->ArgNames({"depth", "block"})
          ->Args({1, 1 << 20})
          ->Args({8, 1 << 20})
          ->Args({32, 1 << 20})
          ->Args({32, 128 << 10})
          ->Iterations(3)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
  }
  for (const auto engine : engines)
    benchmark::RegisterBenchmark((prefix(engine) + "read_behind_compute").c_str(),
                                 [=](benchmark::State& s) { read_behind_compute(s, engine); })
        ->ArgNames({"depth", "block"})
        ->Args({8, 1 << 20})
        ->Args({32, 1 << 20})
        ->Iterations(3)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
