// examples/tokens.hpp, zp_gpt's --tokens: llm.c's token files read back as a byte-level writer
// here lays them out, every window against a serial reference over the files, and each malformed
// file refused with its name and what is wrong.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "temp_dir.hpp"
#include "tokens.hpp"

namespace {

// llm.c's layout, byte by byte: 256 little-endian int32 (magic, version, count, zeros), then
// each token's low byte and high byte.
std::string token_file_bytes(const std::vector<int>& ids, std::int64_t magic = 20240520,
                             std::int64_t version = 1, std::int64_t count = -1) {
  std::string b(1024, '\0');
  const std::int64_t header[3] = {magic, version, count < 0 ? std::int64_t(ids.size()) : count};
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < 4; ++k) b[std::size_t(4 * i + k)] = char((header[i] >> (8 * k)) & 0xff);
  for (int id : ids) {
    b += char(id & 0xff);
    b += char((id >> 8) & 0xff);
  }
  return b;
}

std::string write(const zp::test::TempDir& dir, const std::string& name, const std::string& bytes) {
  const std::string path = (dir.path / name).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

}  // namespace

TEST_CASE("token files: every window is the reference's, none across two files") {
  const std::uint64_t seed = zp::test::fresh_seed();
  INFO("seed ", seed);
  std::mt19937_64 rng(seed);
  zp::test::TempDir dir("tokens");
  const int vocab = 50257, length = 17;
  // Sizes: one window exactly, a few, and one over the reader's 2^19-token check chunk.
  const std::vector<std::size_t> sizes = {length, 40, (std::size_t(1) << 19) + 123};
  std::vector<std::vector<int>> ids;
  std::vector<examples::TokenFile> files;
  for (std::size_t f = 0; f < sizes.size(); ++f) {
    std::vector<int>& v = ids.emplace_back(sizes[f]);
    for (int& t : v) t = int(rng() % std::uint64_t(vocab));
    v.back() = vocab - 1;  // the largest id is taken
    files.emplace_back(write(dir, "f" + std::to_string(f) + ".bin", token_file_bytes(v)), vocab);
    CHECK(files.back().size() == sizes[f]);
  }
  CHECK(files[1].ids() == ids[1]);

  const examples::Windows w(std::move(files), length);
  std::size_t want = 0;
  for (std::size_t s : sizes) want += s - length + 1;
  REQUIRE(w.count() == want);
  CHECK(w.tokens() == sizes[0] + sizes[1] + sizes[2]);
  CHECK(w.files() == 3);
  // The serial reference: files in order, each window starting at every position that fits.
  std::size_t k = 0;
  std::vector<int> got(length);
  for (const auto& v : ids)
    for (std::size_t at = 0; at + length <= v.size(); ++at, ++k) {
      if (k % 997 != 0 && at > 3 && at + length + 3 < v.size()) continue;  // ends and a sample
      std::fill(got.begin(), got.end(), -1);
      w.read(k, got);
      REQUIRE(std::equal(got.begin(), got.end(), v.begin() + std::ptrdiff_t(at)));
    }
  zp::test::expect_invalid([&] { w.read(want, got); }, {"window " + std::to_string(want)});

  // A text's ids: window k starts at id k.
  std::vector<int> text(100);
  for (int& t : text) t = int(rng() % 50);
  const examples::Windows tw(text, length);
  CHECK(tw.count() == text.size() - length + 1);
  tw.read(tw.count() - 1, got);
  CHECK(std::equal(got.begin(), got.end(), text.end() - length));
}

TEST_CASE("token files: each malformed file is an error naming it") {
  zp::test::TempDir dir("tokens-bad");
  const std::vector<int> ids = {1, 2, 3, 4, 5};
  auto refused = [&](const std::string& bytes, std::initializer_list<std::string> needles,
                     int vocab = 6) {
    const std::string path = write(dir, "bad.bin", bytes);
    zp::test::expect_invalid([&] { examples::TokenFile(path, vocab); }, needles);
  };
  const std::string good = token_file_bytes(ids);
  CHECK_NOTHROW(examples::TokenFile(write(dir, "good.bin", good), 6));
  refused(good.substr(0, 1000), {"bad.bin", "1000 bytes, shorter than the 1024-byte header"});
  refused(token_file_bytes(ids, 20240521), {"bad.bin", "starts with 20240521", "magic 20240520"});
  refused(token_file_bytes(ids, 20240520, 2), {"bad.bin", "version 2", "only version 1"});
  refused(token_file_bytes(ids, 20240520, 1, 0x80000000), {"negative token count"});
  refused(token_file_bytes(ids, 20240520, 1, 6), {"1034 bytes", "6 tokens make 1036"});
  refused(good + "x", {"1035 bytes", "5 tokens make 1034"});
  refused(good, {"the token 5 at position 4, not below the vocabulary (5)"}, 5);
  refused(token_file_bytes({0, 65535}), {"the token 65535 at position 1"}, 65535);
  // Too short for one window of the context.
  std::vector<examples::TokenFile> files;
  files.emplace_back(write(dir, "short.bin", good), 6);
  zp::test::expect_invalid([&] { examples::Windows(std::move(files), 6); },
                           {"short.bin has 5 tokens, fewer than a window of --context + 1 (6)"});
  zp::test::expect_error(zp::Errc::io,
                         [&] { examples::TokenFile((dir.path / "none").string(), 6); }, {"none"});
  zp::test::expect_error(zp::Errc::io, [&] { examples::TokenFile(dir.path.string(), 6); },
                         {"a directory"});
  // A file cut short after it was checked: the window's read names it.
  const std::string path = write(dir, "cut.bin", token_file_bytes(std::vector<int>(64, 3)));
  std::vector<examples::TokenFile> cut;
  cut.emplace_back(path, 6);
  const examples::Windows w(std::move(cut), 8);
  std::filesystem::resize_file(path, 1024 + 2 * 32);
  std::vector<int> out(8);
  w.read(10, out);
  zp::test::expect_error(zp::Errc::io, [&] { w.read(40, out); }, {"cut.bin", "truncated"});
}
