// zp_bench_checkpoint: an engine's save_checkpoint, load_checkpoint and export_safetensors against
// writing and reading the same bytes plainly, in the same iterations: what zp's guarantees (a
// staging directory renamed into place, every file and directory synced, a CRC-32C of every byte
// written and verified before a load, the manifest, `latest`) cost over what the disk does anyway.
//
// checkpoint/stage:S/ranks:N  a bf16 AdamW engine (the synthetic model of zp_bench_zero, 8
//   modules of ZP_BENCH_CKPT_ELEMS / 8 parameters, default 64M in all: 1.1 GB of parameters,
//   fp32 master weights and state) on N thread-ranks, its directory in ZP_BENCH_CKPT_DIR
//   (default: the temporary directory; put it on the device to measure). Each iteration, in turn:
//   save    save_checkpoint into a new tag (the previous tag removed first, untimed); the row's
//           time. ckpt_bytes: the checkpoint's bytes; save_GBps: ckpt_bytes / save's time.
//   write   the baseline of save: each rank writes as many bytes as its rank file holds, from
//           memory, as any careful writer would: a new file (write() in 8 MiB pieces,
//           fdatasync) renamed into place, the directory synced; all ranks at once. Its previous
//           file is removed first (untimed), as save's previous tag is, so both write into the
//           blocks just freed (on a thinly provisioned virtual disk, writing blocks never written
//           measured up to 15x slower). write_ms, vs_write = save / write.
//   load    load_checkpoint of that tag (every file verified, then each rank reads its part).
//           load_ms; read_ms: the baseline, each rank reading its plain file (pread in 8 MiB
//           pieces; both from the page cache when the files are still there); vs_read.
//   export  export_safetensors of the bf16 parameters (gathered a bucket at a time, written by
//           rank 0); export_ms; export_write_ms: rank 0 writing as many bytes plainly, as write
//           does, renamed over the previous file (as the export replaces its previous file);
//           export_vs_write.
// Times are rank 0's clock between barriers (manual time), after one untimed round; medians
// over the iterations. On a virtual disk the device's state can outweigh zp (bench/RESULTS.md:
// the first write after the loads paid about 2 s, whichever it was); on tmpfs
// (ZP_BENCH_CKPT_DIR=/dev/shm) the rows show zp's own cost.
//
// crc32c/P  the CRC-32C every checkpoint byte gets, written and read, over a 256 MiB buffer on
//   one thread: P = sse4.2 (the crc32 instruction over three streams; where the CPU has it,
//   zp's path) or portable (slicing-by-8). GBps, and vs_read: that over one core's read
//   bandwidth measured in the same row (membw.hpp's read_gbps).
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <unistd.h>

#include <zp/backend/threads.hpp>
#include <zp/checkpoint.hpp>
#include <zp/engine.hpp>

#include "membw.hpp"
#include "synthetic.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using zp::bf16;
using zp::Collective;
using zp::backend::Threads;

constexpr int modules = 8;
constexpr std::size_t piece = std::size_t(8) << 20;  // the baselines' I/O size

std::size_t weight_elems() {
  const char* v = std::getenv("ZP_BENCH_CKPT_ELEMS");
  const std::size_t n = v ? std::size_t(std::strtoull(v, nullptr, 10)) : std::size_t(64) << 20;
  return std::max<std::size_t>(n / modules, 1);
}

fs::path bench_dir() {
  const char* d = std::getenv("ZP_BENCH_CKPT_DIR");
  return (d ? fs::path(d) : fs::temp_directory_path()) / "zp-bench-checkpoint";
}

struct Model : zp::bench::SyntheticParams<modules> {
  std::vector<bf16> grad_w;
  Model() : SyntheticParams(weight_elems(), 1000), grad_w(weight_elems()) {
    for (std::size_t i = 0; i < grad_w.size(); ++i) grad_w[i] = weight_grad(i);
  }
  void forward(int) {}
  void backward(int m) {
    std::memcpy(static_cast<void*>(w[m].grad.data()), grad_w.data(), grad_w.size() * sizeof(bf16));
    for (std::size_t i = 0; i < b[m].grad.size(); ++i) b[m].grad[i] = bf16(1e-3f);
  }
};

[[noreturn]] void fail(const char* call, const fs::path& p) {
  throw zp::Error(zp::Errc::io, zp::detail::cat(call, " ", p.string(), ": ", std::strerror(errno)));
}

void sync_dir(const fs::path& d) {
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) fail("fsync", d);
  ::close(fd);
}

// The baseline of a save: `bytes` from memory into a new file, fdatasync, renamed to `p`, the
// directory synced.
void write_plain(const fs::path& p, const std::vector<char>& from, std::uint64_t bytes) {
  const fs::path fresh = fs::path(p) += ".new";
  const int fd = ::open(fresh.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", fresh);
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = std::size_t(std::min<std::uint64_t>(from.size(), bytes - at));
    const ssize_t w = ::write(fd, from.data(), n);
    if (w <= 0) fail("write", fresh);
    at += std::uint64_t(w);
  }
  if (::fdatasync(fd) != 0) fail("fdatasync", fresh);
  ::close(fd);
  if (::rename(fresh.c_str(), p.c_str()) != 0) fail("rename", fresh);
  sync_dir(p.parent_path());
}

// The baseline of a load: the whole of `p`, `into.size()` bytes at a time.
void read_plain(const fs::path& p, std::vector<char>& into) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open", p);
  for (off_t at = 0;;) {
    const ssize_t r = ::pread(fd, into.data(), into.size(), at);
    if (r < 0) fail("pread", p);
    if (r == 0) break;
    at += r;
  }
  ::close(fd);
}

struct Times {
  std::vector<double> save, write, load, read, exp, exp_write;
  double ckpt_bytes = 0, export_bytes = 0;
};

double median(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

template <int Stage>
Times measure(int ranks, int iterations) {
  Times out;
  const fs::path dir = bench_dir();
  fs::remove_all(dir);
  fs::create_directories(dir / "plain");
  struct Cleanup {  // a gigabyte or more, also when a rank fails
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};
  zp::backend::run_threads(ranks, [&](Collective<Threads>& comm) {
    using clock = std::chrono::steady_clock;
    const int r = comm.rank();
    Model model;
    zp::Engine<Threads, bf16, Stage> engine(comm, model, zp::EngineConfig{}, zp::optim::AdamW{});
    zp::bench::train_step(engine, model);  // state that is not all zeros
    std::vector<char> buf(piece, 'z');
    // Runs f on every rank between barriers; rank 0's seconds.
    const auto timed = [&](auto&& f) {
      comm.barrier();
      const auto t0 = clock::now();
      f();
      comm.barrier();
      return std::chrono::duration<double>(clock::now() - t0).count();
    };
    for (int i = -1; i < iterations; ++i) {  // round -1: untimed
      const std::string tag = zp::detail::cat("it", i + 1);
      if (r == 0 && i >= 0) fs::remove_all(dir / zp::detail::cat("it", i));
      const double save = timed([&] { zp::save_checkpoint(engine, dir, tag); });
      const zp::ckpt::Reader rd(dir, tag);
      const auto& files = rd.manifest().files;
      const fs::path mine = dir / "plain" / zp::detail::cat("rank", r);
      fs::remove(mine);
      const double write = timed([&] { write_plain(mine, buf, files.at(std::size_t(r)).bytes); });
      const double load = timed([&] { (void)zp::load_checkpoint(engine, dir, tag); });
      const double read = timed([&] { read_plain(mine, buf); });
      const double exp = timed([&] { zp::export_safetensors(engine, dir / "export"); });
      const std::uint64_t exported = fs::file_size(dir / "export" / "model.safetensors");
      const double exp_write = timed([&] {
        if (r == 0) write_plain(dir / "plain" / "export", buf, exported);
      });
      if (r == 0 && i >= 0) {
        out.save.push_back(save), out.write.push_back(write), out.load.push_back(load);
        out.read.push_back(read), out.exp.push_back(exp), out.exp_write.push_back(exp_write);
        out.ckpt_bytes = 0;
        for (const auto& f : files) out.ckpt_bytes += double(f.bytes);
        out.export_bytes = double(exported);
      }
    }
  });
  return out;
}

template <int Stage>
void checkpoint(benchmark::State& state) {
  Times t;
  try {
    t = measure<Stage>(int(state.range(0)), int(state.max_iterations));
  } catch (const std::exception& e) {
    return state.SkipWithError(e.what());
  }
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(t.save[i++ % t.save.size()]);
  const double save = median(t.save), load = median(t.load), exp = median(t.exp);
  state.counters["ckpt_bytes"] = t.ckpt_bytes;
  state.counters["save_GBps"] = t.ckpt_bytes / save / 1e9;
  state.counters["write_ms"] = median(t.write) * 1e3;
  state.counters["vs_write"] = save / median(t.write);
  state.counters["load_ms"] = load * 1e3;
  state.counters["read_ms"] = median(t.read) * 1e3;
  state.counters["vs_read"] = load / median(t.read);
  state.counters["export_bytes"] = t.export_bytes;
  state.counters["export_ms"] = exp * 1e3;
  state.counters["export_write_ms"] = median(t.exp_write) * 1e3;
  state.counters["export_vs_write"] = exp / median(t.exp_write);
}

void crc32c(benchmark::State& state, bool hw) {
#if ZP_FILE_X86
  if (hw && !zp::detail::crc32c_sse42_supported()) return state.SkipWithError("no SSE4.2 here");
#else
  if (hw) return state.SkipWithError("no SSE4.2 path on this architecture");
#endif
  const std::size_t bytes = zp::bench::out_of_cache_bytes;
  std::vector<std::byte> data(bytes);
  for (std::size_t i = 0; i < bytes; ++i) data[i] = std::byte(i * 2654435761u >> 13);
  std::uint32_t sum = 0;
  for (auto _ : state) {
#if ZP_FILE_X86
    sum ^= hw ? zp::detail::crc32c_sse42(data) : zp::detail::crc32c_portable(data);
#else
    sum ^= zp::detail::crc32c_portable(data);
#endif
    benchmark::DoNotOptimize(sum);
  }
  // Rates: the bytes over the row's time, and that over the read bandwidth.
  const double gb = double(bytes) * double(state.iterations()) / 1e9,
               read = zp::bench::read_gbps(bytes);
  state.counters["GBps"] = benchmark::Counter(gb, benchmark::Counter::kIsRate);
  state.counters["read_GBps"] = read;
  state.counters["vs_read"] = benchmark::Counter(gb / read, benchmark::Counter::kIsRate);
}
BENCHMARK_CAPTURE(crc32c, sse42, true)->Name("crc32c/sse4.2")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(crc32c, portable, false)->Name("crc32c/portable")->Unit(benchmark::kMillisecond);

BENCHMARK(checkpoint<1>)
    ->Name("checkpoint/stage:1")
    ->ArgName("ranks")
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(7);
BENCHMARK(checkpoint<3>)
    ->Name("checkpoint/stage:3")
    ->ArgName("ranks")
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(7);

}  // namespace

BENCHMARK_MAIN();
