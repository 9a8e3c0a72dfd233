// Tests of zp/detail/file.hpp: CRC-32C against a bitwise reference, AtomicFile's all-or-nothing
// publication (including a fault injected before each durable step) and InputFile's errors.
#include "zp/detail/file.hpp"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../expect_error.hpp"
#include "../random.hpp"
#include "../temp_dir.hpp"

namespace fs = std::filesystem;
using zp::detail::crc32c;

using zp::test::expect_error;
using zp::test::TempDir;

namespace {

std::span<const std::byte> bytes_of(std::string_view s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

std::string slurp(const fs::path& p) {
  const zp::detail::InputFile f(p);
  std::string s(f.size(), '\0');
  f.read_at(0, std::as_writable_bytes(std::span(s)));
  return s;
}

// The definition, one bit at a time: what the table-driven version must agree with.
std::uint32_t crc32c_bitwise(std::span<const std::byte> data) {
  std::uint32_t c = 0xffffffffu;
  for (std::byte b : data) {
    c ^= std::uint32_t(b);
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

std::vector<std::byte> random_bytes(std::uint64_t seed, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::byte(zp::test::mix(seed + i));
  return v;
}

// Every path crc32c may take on this CPU (the dispatching one first), by name.
using Crc = std::uint32_t (*)(std::span<const std::byte>, std::uint32_t) noexcept;
std::vector<std::pair<const char*, Crc>> crc_paths() {
  std::vector<std::pair<const char*, Crc>> out{{"dispatched", &zp::detail::crc32c},
                                               {"portable", &zp::detail::crc32c_portable}};
#if ZP_FILE_X86
  if (zp::detail::crc32c_sse42_supported()) out.emplace_back("sse4.2", &zp::detail::crc32c_sse42);
#endif
  return out;
}

}  // namespace

TEST_CASE("crc32c gives the published check values") {
  for (const auto& [path, crc] : crc_paths()) {
    CAPTURE(path);
    CHECK(crc(bytes_of("123456789"), 0) == 0xE3069283u);
    CHECK(crc({}, 0) == 0u);
    // RFC 3720 (iSCSI), appendix B.4.
    std::vector<std::byte> v(32, std::byte{0});
    CHECK(crc(v, 0) == 0x8A9136AAu);
    std::fill(v.begin(), v.end(), std::byte{0xff});
    CHECK(crc(v, 0) == 0x62A8AB43u);
    for (int i = 0; i < 32; ++i) v[i] = std::byte(i);
    CHECK(crc(v, 0) == 0x46DD794Eu);
    for (int i = 0; i < 32; ++i) v[i] = std::byte(31 - i);
    CHECK(crc(v, 0) == 0x113FDB5Cu);
  }
}

TEST_CASE("crc32c continued piece by piece equals one pass and the bitwise definition") {
  const std::uint64_t seed = zp::test::fresh_seed();
  MESSAGE("seed ", seed);
  const auto paths = crc_paths();
  MESSAGE(paths.size(), " paths (", std::string(paths.back().first), " the last)");
#if ZP_FILE_X86
  constexpr std::size_t s = zp::detail::crc32c_stream_bytes;  // the SSE4.2 path's rounds of 3 s
#else
  constexpr std::size_t s = 8192;
#endif
  for (std::size_t n :
       {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(8), std::size_t(9),
        std::size_t(15), std::size_t(16), std::size_t(17), std::size_t(63), std::size_t(64),
        std::size_t(1000), std::size_t(4099), 3 * s - 1, 3 * s, 3 * s + 9, 7 * s + 5}) {
    const auto data = random_bytes(seed + n, n);
    const std::span<const std::byte> all(data);
    const std::uint32_t want = crc32c_bitwise(all);
    for (const auto& [path, crc] : paths) {
      CAPTURE(n);
      CAPTURE(path);
      CHECK(crc(all, 0) == want);
      // Continued from a CRC that is not 0, over whole rounds of the streams.
      const std::size_t cut = std::min(n, n / 3 + 5);
      CHECK(crc(all.subspan(cut), crc(all.first(cut), 0)) == want);
      // Pieces of every alignment, the empty piece included.
      std::uint32_t c = 0;
      for (std::size_t at = 0, k = 0; at < n || k == 0; ++k) {
        const std::size_t len = std::min<std::size_t>(n - at, zp::test::mix(seed ^ k) % 13);
        c = crc(all.subspan(at, len), c);
        at += len;
      }
      CHECK(c == want);
    }
  }
}

TEST_CASE("a committed AtomicFile holds exactly the bytes written") {
  TempDir dir;
  const fs::path p = dir.path / "weights.bin";
  const auto data = random_bytes(7, 10000);
  const std::span<const std::byte> all(data);
  {
    zp::detail::AtomicFile f(p);
    CHECK(dir.entries().size() == 1);  // the temporary
    CHECK_FALSE(fs::exists(p));
    f.write(all.first(3));
    f.write(all.subspan(3, 0));
    f.write(all.subspan(3));
    CHECK(f.bytes() == data.size());
    CHECK(f.crc32c() == crc32c(all));
    f.commit();
  }
  CHECK(dir.entries() == std::vector<std::string>{"weights.bin"});
  const zp::detail::InputFile in(p);
  CHECK(in.size() == data.size());
  std::vector<std::byte> back(data.size());
  in.read_at(0, back);
  CHECK(back == data);
  CHECK(in.crc32c_of_all() == crc32c(all));
  // Buffers of one byte (0 asks for one), 7, around the file's size, and larger.
  // Each reports every byte, a chunk of min(buffer, size) at a time.
  for (const std::size_t b : {std::size_t(0), std::size_t(1), std::size_t(7), data.size() - 1,
                              data.size(), data.size() + 1, std::size_t(1) << 20}) {
    std::size_t calls = 0, read = 0;
    CHECK(in.crc32c_of_all(b, [&](std::size_t n) { ++calls, read += n; }) == crc32c(all));
    CHECK(read == data.size());
    const std::size_t chunk = std::min(data.size(), std::max<std::size_t>(b, 1));
    CHECK(calls == (data.size() + chunk - 1) / chunk);
  }
  {  // an empty file: nothing read (its own directory: the subcases below count dir's entries)
    const TempDir other;
    zp::detail::AtomicFile(other.path / "empty.bin").commit();
    CHECK(zp::detail::InputFile(other.path / "empty.bin").crc32c_of_all() ==
          crc32c(std::span<const std::byte>{}));
  }

  SUBCASE("write_file_atomic replaces a file") {
    zp::detail::write_file_atomic(p, bytes_of("new"));
    CHECK(slurp(p) == "new");
    CHECK(dir.entries().size() == 1);
  }
  SUBCASE("writing after commit and committing twice are errors") {
    zp::detail::AtomicFile f(dir.path / "x");
    f.commit();
    expect_error(zp::Errc::invalid_argument, [&] { f.write(bytes_of("a")); },
                 {"write after commit"});
    expect_error(zp::Errc::invalid_argument, [&] { f.commit(); }, {"commit called twice"});
  }
}

TEST_CASE("an AtomicFile destroyed without commit leaves no file and no temporary") {
  TempDir dir;
  const fs::path p = dir.path / "state.bin";
  { zp::detail::AtomicFile f(p); }
  {
    zp::detail::AtomicFile f(p);
    f.write(bytes_of("partial"));
  }
  CHECK(dir.entries().empty());
  zp::detail::write_file_atomic(p, bytes_of("old"));
  {
    zp::detail::AtomicFile f(p);
    f.write(bytes_of("never published"));
  }
  CHECK(dir.entries() == std::vector<std::string>{"state.bin"});
  CHECK(slurp(p) == "old");
}

TEST_CASE(
    "a fault before any durable step leaves the old or the new version, complete, and no "
    "temporary") {
  bool had_old = false;
  SUBCASE("over a previous version") { had_old = true; }
  SUBCASE("where no file was") { had_old = false; }
  CAPTURE(had_old);
  TempDir dir;
  const fs::path p = dir.path / "checkpoint.bin";
  const std::string old_version = "old version, complete";
  const std::string new_version = "new version: three parts, all written";
  if (had_old) zp::detail::write_file_atomic(p, bytes_of(old_version));
  // The steps: three writes, fsync, rename, directory fsync; the 7th attempt runs them all.
  const char* steps[] = {"write", "write", "write", "fsync", "rename", "directory fsync"};
  bool done = false;
  for (std::int64_t k = 1; !done; ++k) {
    CAPTURE(k);
    REQUIRE(k <= 7);
    zp::detail::io_fault_countdown() = k;
    try {
      zp::detail::AtomicFile f(p);
      const std::string_view s = new_version;
      f.write(bytes_of(s.substr(0, 10)));
      f.write(bytes_of(s.substr(10, 10)));
      f.write(bytes_of(s.substr(20)));
      f.commit();
      done = true;
      CHECK(k == 7);
    } catch (const zp::Error& e) {
      CHECK(e.category() == zp::Errc::io);
      CHECK(e.message() ==
            std::string("injected fault before ") + steps[k - 1] + " of " + p.native());
    }
    zp::detail::io_fault_countdown() = -1;
    // The rename is the moment of publication: before it the old version (or none), from it on
    // the new one.
    if (k < 6 && !had_old) {
      CHECK(dir.entries().empty());
    } else {
      CHECK(dir.entries() == std::vector<std::string>{"checkpoint.bin"});
      CHECK(slurp(p) == (k >= 6 ? new_version : old_version));
    }
  }
}

TEST_CASE("file errors name the path, the operation and the reason") {
  TempDir dir;
  const fs::path missing_dir = dir.path / "no" / "such" / "dir" / "f.bin";
  expect_error(zp::Errc::io, [&] { zp::detail::AtomicFile f(missing_dir); },
               {"cannot create", (dir.path / "no/such/dir/f.bin.tmp.").native(),
                "No such file or directory"});
  expect_error(zp::Errc::io, [&] { zp::detail::InputFile f(dir.path / "absent"); },
               {"cannot open", (dir.path / "absent").native(), "No such file or directory"});
  expect_error(zp::Errc::io, [&] { zp::detail::InputFile f(dir.path); },
               {dir.path.native(), "not a regular file"});

  const fs::path p = dir.path / "ten";
  zp::detail::write_file_atomic(p, bytes_of("0123456789"));
  const zp::detail::InputFile f(p);
  std::vector<std::byte> buf(8);
  f.read_at(2, buf);
  CHECK(std::string(reinterpret_cast<const char*>(buf.data()), 8) == "23456789");
  expect_error(zp::Errc::io, [&] { f.read_at(4, buf); },
               {"file " + p.native() + " is truncated: wanted bytes [4, 12) but it has 10 bytes"});
  expect_error(zp::Errc::io, [&] { f.read_at(100, buf); },
               {"wanted bytes [100, 108) but it has 10 bytes"});
  f.read_at(10, std::span<std::byte>());  // an empty read at the end is fine
}

TEST_CASE(
    "only regular files are read: a FIFO, a directory or an oversized file is an error, never a "
    "wait") {
  TempDir dir;
  const auto fifo = dir.path / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) ==
          0);  // no writer ever opens it: a blocking open would wait forever
  expect_error(zp::Errc::io, [&] { zp::detail::InputFile f(fifo); },
               {fifo.native(), "not a regular file (a FIFO)"});
  expect_error(zp::Errc::io, [&] { (void)zp::detail::read_whole_file(fifo, 100); }, {"a FIFO"});
  expect_error(zp::Errc::io, [&] { zp::detail::InputFile f(dir.path); },
               {"not a regular file (a directory)"});
  const auto big = dir.path / "big";
  const std::string text(101, 'x');
  zp::detail::write_file_atomic(big, std::as_bytes(std::span(text)));
  expect_error(zp::Errc::io, [&] { (void)zp::detail::read_whole_file(big, 100); },
               {"101 bytes", "100-byte limit"});
  CHECK(zp::detail::read_whole_file(big, 101) == std::string(101, 'x'));
}

TEST_CASE(
    "a DirectoryLock excludes every other holder, in this process too, and a no-replace rename "
    "never replaces") {
  TempDir dir;
  {
    zp::detail::DirectoryLock first(dir.path, ".lock", "writer");
    expect_error(zp::Errc::io,
                 [&] { zp::detail::DirectoryLock second(dir.path, ".lock", "writer"); },
                 {"is locked by another writer", ".lock"});
  }
  zp::detail::DirectoryLock again(dir.path, ".lock", "writer");  // released with its holder
  const auto a = dir.path / "a", b = dir.path / "b";
  std::filesystem::create_directory(a);
  std::filesystem::create_directory(b);  // empty: plain rename(2) would replace it
  expect_error(zp::Errc::io, [&] { zp::detail::rename_no_replace(a, b); },
               {"rename", "File exists"});
  CHECK(std::filesystem::exists(a));
  zp::detail::rename_no_replace(a, dir.path / "c");
  CHECK(std::filesystem::exists(dir.path / "c"));
}
