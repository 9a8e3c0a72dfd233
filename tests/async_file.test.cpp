// zp/async_file.hpp: round trips of random bytes through files at several block sizes and queue
// depths, against the bytes written (every byte of a poisoned buffer read back); transfers
// that reach their end while the caller does not wait; several transfers in flight finished in
// any order; reads past the end of the file, writes past the
// process's file-size limit, files that cannot be opened and misaligned O_DIRECT requests are
// errors naming the file, the call, the offset and the value. Each on both engines (io_uring and
// threads; threads alone where the system refuses io_uring, as zp.test.async_file.no_io_uring
// makes it do, or where a kernel before 5.6 lacks its reads and writes, as .io_uring_before_5_6
// makes it look), and a File left to choose takes io_uring where it can, else threads.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "temp_dir.hpp"
#include "zp/async_file.hpp"

namespace {

using zp::aio::AlignedBuffer;
using zp::aio::Engine;
using zp::aio::File;
using zp::aio::Mode;

void fill_random(std::span<std::byte> b, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& x : b) x = std::byte(rng() & 0xff);
}

// Whether this process may use io_uring for reads and writes (a seccomp profile or the sysctl
// kernel.io_uring_disabled may refuse it; before Linux 5.6 it has no IORING_OP_READ/WRITE),
// asked of the kernel directly.
bool io_uring_allowed() {
  io_uring ring;
  if (io_uring_queue_init(1, &ring, 0) != 0) return false;
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  const bool ops = probe && io_uring_opcode_supported(probe, IORING_OP_READ) &&
                   io_uring_opcode_supported(probe, IORING_OP_WRITE);
  if (probe) io_uring_free_probe(probe);
  io_uring_queue_exit(&ring);
  return ops;
}

// The engines to test: both, or threads alone where io_uring is refused.
std::vector<Engine> engines() {
  if (io_uring_allowed()) return {Engine::io_uring, Engine::threads};
  return {Engine::threads};
}

}  // namespace

TEST_CASE("random bytes go out and come back at every block size and queue depth") {
  zp::test::TempDir dir("aio");
  const std::uint64_t seed = zp::test::fresh_seed();
  const std::size_t bytes =
      (std::size_t(3) << 20) + 5 * zp::aio::alignment;  // not a block multiple
  AlignedBuffer out(bytes), in(bytes);
  fill_random(out.span(), seed);
  for (const Engine e : engines())
    for (std::size_t block : {std::size_t(4096), std::size_t(64) << 10, std::size_t(1) << 20})
      for (unsigned depth : {1u, 4u, 32u}) {
        const std::string engine = name(e);
        CAPTURE(engine);
        CAPTURE(block);
        CAPTURE(depth);
        File f(dir.path / "round.bin", Mode::read_write,
               {.queue_depth = depth, .block_bytes = block, .engine = e});
        CHECK(f.engine() == e);
        const std::uint64_t at = 8 * zp::aio::alignment;  // leaves a hole before it
        f.write(out.span(), at);
        f.sync();
        CHECK(f.size() == at + bytes);
        std::fill(in.span().begin(), in.span().end(), std::byte{0xa5});
        f.read(in.span(), at);
        CHECK(std::memcmp(in.span().data(), out.span().data(), bytes) == 0);
      }
}

TEST_CASE("several transfers in flight finish in any order") {
  zp::test::TempDir dir("aio");
  const std::uint64_t seed = zp::test::fresh_seed();
  const std::size_t piece = std::size_t(256) << 10;
  std::vector<AlignedBuffer> out, in;
  for (int k = 0; k < 4; ++k) {
    out.emplace_back(piece);
    in.emplace_back(piece);
    fill_random(out.back().span(), seed + std::uint64_t(k));
  }
  for (const Engine e : engines()) {
    const std::string engine = name(e);
    CAPTURE(engine);
    for (auto& b : in) std::fill(b.span().begin(), b.span().end(), std::byte{0xa5});
    File f(dir.path / "many.bin", Mode::read_write,
           {.queue_depth = 3, .block_bytes = 64 << 10, .engine = e});
    std::vector<zp::aio::Transfer> w, r;
    for (int k = 0; k < 4; ++k) w.push_back(f.write_async(out[std::size_t(k)].span(), k * piece));
    for (int k = 3; k >= 0; --k) f.wait(w[std::size_t(k)]);
    for (int k = 0; k < 4; ++k) r.push_back(f.read_async(in[std::size_t(k)].span(), k * piece));
    f.wait(r[2]);
    f.wait(r[0]);
    f.wait(r[3]);
    f.wait(r[1]);
    f.wait(r[1]);  // finished already: returns
    for (std::size_t k = 0; k < 4; ++k)
      CHECK(std::memcmp(in[k].span().data(), out[k].span().data(), piece) == 0);
  }
}

TEST_CASE("more requests than the ring has entries go through one File, each transfer in turn") {
  // io_uring reuses its entries: one the File's thread prepares again must carry nothing of the
  // request it held before (a stale one made a finished request of the wake-up read and hung).
  zp::test::TempDir dir("aio");
  const std::uint64_t seed = zp::test::fresh_seed();
  constexpr std::size_t pages = 8, transfers = 640;  // 5120 requests of a page
  const std::size_t piece = pages * zp::aio::alignment;
  AlignedBuffer out(piece * 2), in(piece);
  fill_random(out.span(), seed);
  for (const Engine e : engines()) {
    const std::string engine = name(e);
    CAPTURE(engine);
    File f(dir.path / "reuse.bin", Mode::read_write,
           {.queue_depth = 3, .block_bytes = zp::aio::alignment, .engine = e});
    for (std::size_t k = 0; k < transfers; k += 2) {
      CAPTURE(k);
      const auto src = out.span().subspan(k / 2 % 2 * piece, piece);  // either half, in turn
      f.write(src, k * piece);
      std::fill(in.span().begin(), in.span().end(), std::byte{0xa5});
      f.read(in.span(), k * piece);
      REQUIRE(std::memcmp(in.span().data(), src.data(), piece) == 0);
    }
  }
}

// A transfer must move while its caller computes (the swap's read-ahead relies on it): each
// transfer here is watched, without a call into the File, until its bytes are where they belong.
TEST_CASE("a transfer runs to its end without the caller waiting for it") {
  zp::test::TempDir dir("aio");
  const std::size_t bytes = std::size_t(3) << 20;  // 48 requests in 4 chains
  AlignedBuffer out(bytes), in(bytes);
  fill_random(out.span(), zp::test::fresh_seed());
  const auto path = dir.path / "ahead.bin";
  // Whether the bytes were seen where they belong once. Only that: until wait() finishes the
  // transfer the buffer is the kernel's, and on this project's VM a later look may catch it
  // changing (bytes seen equal, then old ones again, right once waited for).
  const auto arrives = [](auto&& equal) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (; std::chrono::steady_clock::now() < deadline;
         std::this_thread::sleep_for(std::chrono::milliseconds(1)))
      if (equal()) return true;
    return false;
  };
  for (const Engine e : engines()) {
    const std::string engine = name(e);
    CAPTURE(engine);
    std::filesystem::remove(path);
    std::fill(in.span().begin(), in.span().end(), std::byte{0xa5});
    File f(path, Mode::read_write, {.queue_depth = 4, .block_bytes = 64 << 10, .engine = e});
    const zp::aio::Transfer w = f.write_async(out.span(), 0);
    CHECK(arrives([&] {  // through another descriptor, which sees what reached the file
      std::vector<std::byte> back(bytes);
      std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(back.data()), bytes);
      return std::memcmp(back.data(), out.span().data(), bytes) == 0;
    }));
    f.wait(w);
    const zp::aio::Transfer r = f.read_async(in.span(), 0);
    // Into memory the threads engine's threads write: a look before wait() would be a data race
    // (the write above shows that they run without the caller).
    if (e == Engine::io_uring)
      CHECK(arrives([&] { return std::memcmp(in.span().data(), out.span().data(), bytes) == 0; }));
    f.wait(r);
    CHECK(std::memcmp(in.span().data(), out.span().data(), bytes) == 0);
  }
}

TEST_CASE("without O_DIRECT any address, offset and length work") {
  zp::test::TempDir dir("aio");
  std::vector<std::byte> out(10007), in(10007, std::byte{0});
  fill_random(out, zp::test::fresh_seed());
  for (const Engine e : engines()) {
    const std::string engine = name(e);
    CAPTURE(engine);
    std::fill(in.begin(), in.end(), std::byte{0});
    File f(dir.path / "plain.bin", Mode::read_write,
           {.block_bytes = 4096, .direct = false, .engine = e});
    CHECK_FALSE(f.direct());
    f.write(std::span<const std::byte>(out).subspan(1), 13);
    f.read(std::span<std::byte>(in).subspan(1), 13);
    CHECK(std::equal(in.begin() + 1, in.end(), out.begin() + 1));
  }
}

TEST_CASE("failures are errors naming the file, the call, the offset and the value") {
  zp::test::TempDir dir("aio");
  const auto path = dir.path / "short.bin";
  AlignedBuffer buf(4 * zp::aio::alignment);
  fill_random(buf.span(), zp::test::fresh_seed());
  {
    File f(path, Mode::read_write);
    f.write(buf.span().first(2 * zp::aio::alignment), 0);
  }
  // A file whose size is no multiple of the alignment.
  const auto odd = dir.path / "odd.bin";
  std::filesystem::copy_file(path, odd);
  std::filesystem::resize_file(odd, 2 * zp::aio::alignment + 100);
  for (const Engine e : engines()) {
    const std::string engine = name(e);
    CAPTURE(engine);
    File f(path, Mode::read, {.engine = e});
    // Past the end: the second half of the read finds no bytes (in one request, and in a chain
    // of four whose third and fourth find none).
    zp::test::expect_error(zp::Errc::io, [&] { f.read(buf.span(), 0); },
                           {"aio: read of '", "short.bin' at offset 8192", "the file ends there"});
    zp::test::expect_error(zp::Errc::io,
                           [&] {
                             File(path, Mode::read,
                                  {.queue_depth = 1, .block_bytes = 4096, .engine = e})
                                 .read(buf.span(), 0);
                           },
                           {"aio: read of '", "short.bin' at offset 8192", "the file ends there"});
    // The file is still usable after an error.
    f.read(buf.span().first(zp::aio::alignment), zp::aio::alignment);
    // The odd file: the read stops short at its end, and the rest (from an offset O_DIRECT
    // could not start a read at) is named as past the file's end.
    zp::test::expect_error(
        zp::Errc::io, [&] { File(odd, Mode::read, {.engine = e}).read(buf.span(), 0); },
        {"aio: read of '", "odd.bin' at offset 8292 (8092 bytes)", "the file ends there"});
    zp::test::expect_error(
        zp::Errc::io,
        [&] { File(dir.path / "missing" / "x.bin", Mode::read_write, {.engine = e}); },
        {"aio: open of '", "missing/x.bin'", "No such file or directory"});
    if (f.direct()) {
      zp::test::expect_invalid([&] { f.read(buf.span().subspan(1, 4096), 0); },
                               {"buffer address", "is not a multiple of 4096", "AlignedBuffer"});
      zp::test::expect_invalid([&] { f.read(buf.span().first(4096), 100); },
                               {"offset 100 and length 4096 must be multiples of 4096"});
    } else {
      MESSAGE("the temporary directory's file system refuses O_DIRECT: alignment not checked");
    }
  }
  zp::test::expect_invalid([&] { File(path, Mode::read, {.queue_depth = 0}); },
                           {"queue_depth 0 is not in [1, 4096]"});
  zp::test::expect_invalid([&] { File(path, Mode::read, {.block_bytes = 1000}); },
                           {"block_bytes 1000 is not a multiple of 4096"});
}

// Fifteen of the sixteen requests fail, in whatever order they complete: the error names the
// lowest offset past the limit, every time.
TEST_CASE("a write past the process's file-size limit is an error naming it") {
  zp::test::TempDir dir("aio");
  AlignedBuffer buf(std::size_t(1) << 20);
  fill_random(buf.span(), zp::test::fresh_seed());
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  const auto before = ::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  rlimit lim = old;
  lim.rlim_cur = 64 << 10;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
  for (const Engine e : engines()) {
    const std::string engine = name(e);
    CAPTURE(engine);
    std::filesystem::remove(dir.path / "big.bin");
    File f(dir.path / "big.bin", Mode::read_write, {.block_bytes = 64 << 10, .engine = e});
    zp::test::expect_error(zp::Errc::io, [&] { f.write(buf.span(), 0); },
                           {"aio: write of '", "big.bin' at offset 65536", "File too large"});
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, before);
}

// What a File left to choose runs on: io_uring where the process may use it; where it may not
// (zp.test.async_file.no_io_uring runs this under a seccomp filter that refuses it, as Docker's
// default profile does; .io_uring_before_5_6 under one that makes it look as before Linux 5.6),
// threads, while a File that asks for io_uring is an error saying why.
TEST_CASE("a File takes io_uring where it is allowed, else threads") {
  zp::test::TempDir dir("aio");
  const auto path = dir.path / "auto.bin";
  AlignedBuffer out(std::size_t(1) << 20), in(std::size_t(1) << 20);
  fill_random(out.span(), zp::test::fresh_seed());
  std::fill(in.span().begin(), in.span().end(), std::byte{0xa5});
  File f(path, Mode::read_write, {.queue_depth = 4, .block_bytes = 64 << 10});
  f.write(out.span(), 0);
  f.read(in.span(), 0);
  CHECK(std::memcmp(in.span().data(), out.span().data(), out.span().size()) == 0);
  if (io_uring_allowed()) {
    CHECK(f.engine() == Engine::io_uring);
  } else {
    MESSAGE("io_uring is refused to this process: the threads engine runs");
    CHECK(f.engine() == Engine::threads);
    // tests/no_io_uring.cpp says which refusal it made: io_uring_setup's EPERM (Docker's), or
    // a kernel before 5.6 (no operations to list).
    const char* refusal = std::getenv("ZP_TEST_IO_URING_REFUSAL");
    const std::string why = refusal && std::string(refusal) == "before-5.6"
                                ? "no IORING_OP_READ and IORING_OP_WRITE (Linux 5.6 added them)"
                                : "io_uring_queue_init: Operation not permitted";
    zp::test::expect_error(zp::Errc::io,
                           [&] { File(path, Mode::read, {.engine = Engine::io_uring}); },
                           {"aio: io_uring of '", "auto.bin'", why.c_str(),
                            "Engine::threads or automatic runs without it"});
  }
}
