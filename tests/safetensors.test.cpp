// Tests of zp/safetensors.hpp: round trips of every dtype, the Writer's and Reader's named
// errors, one check per malformed header, the split-model index, and a fuzz of the Reader.
// tests/safetensors_check.py checks the format against the Python reference implementation.
#include "zp/safetensors.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
namespace st = zp::safetensors;

using zp::test::expect_error;
using zp::test::TempDir;

namespace {

std::vector<std::byte> random_bytes(std::uint64_t seed, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::byte(zp::test::mix(seed + i));
  return v;
}

void put_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), std::streamsize(bytes.size()));
}

// A file with header length `n` (the header's own length unless given), the header, `data` bytes.
std::string raw_file(const std::string& header, std::size_t data,
                     std::optional<std::uint64_t> n = {}) {
  const std::uint64_t len = n.value_or(header.size());
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char(len >> (8 * i));
  return s + header + std::string(data, '\x5a');
}

std::vector<std::byte> read_all(const st::Reader& r, const st::TensorInfo& t) {
  std::vector<std::byte> v(t.bytes());
  r.read(t.name, 0, v);
  return v;
}

}  // namespace

TEST_CASE("dtype names and sizes") {
  CHECK(st::element_types.size() == 15);
  CHECK(st::element_size("BF16") == 2u);
  CHECK(st::element_size("F8_E5M2") == 1u);
  CHECK(st::element_size("U64") == 8u);
  CHECK_FALSE(st::element_size("f32"));
  for (zp::DType t : {zp::DType::f32, zp::DType::f64, zp::DType::i32, zp::DType::i64,
                      zp::DType::bf16, zp::DType::f16}) {
    CHECK(st::to_zp(st::dtype_name(t)) == t);
    CHECK(st::element_size(st::dtype_name(t)) == zp::size_of(t));
  }
  CHECK_FALSE(st::to_zp("U8"));
  CHECK(st::shard_file_name(1, 3) == "model-00001-of-00003.safetensors");
  CHECK(st::shard_file_name(12, 12) == "model-00012-of-00012.safetensors");
  expect_error(zp::Errc::invalid_argument, [] { (void)st::shard_file_name(0, 3); },
               {"shard 0 of 3"});
  expect_error(zp::Errc::invalid_argument, [] { (void)st::shard_file_name(4, 3); },
               {"shard 4 of 3"});
}

TEST_CASE("tensors of every dtype round-trip bitwise, with metadata") {
  const std::uint64_t seed = zp::test::fresh_seed();
  MESSAGE("seed ", seed);
  TempDir dir;
  const fs::path p = dir.path / "model.safetensors";
  std::vector<st::TensorInfo> decl = {
      {"f64", "F64", {2, 3}},      {"f32", "F32", {3, 5}}, {"i64", "I64", {4}},
      {"i32", "I32", {11}},        {"bf16", "BF16", {7}},  {"f16", "F16", {2, 2, 3}},
      {"u8", "U8", {5}},           {"scalar", "F32", {}},  {"empty", "F32", {0, 3}},
      {"empty.bf16", "BF16", {0}}, {"flags", "BOOL", {3}}, {"after.empty", "I32", {2}},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"note", "zp \"test\" \u00e9"}};
  std::vector<std::byte> data;
  std::map<std::string, std::vector<std::byte>> want;
  for (std::size_t i = 0; i < decl.size(); ++i) {
    const std::size_t n = std::size_t(decl[i].elements() * *st::element_size(decl[i].dtype));
    want[decl[i].name] = random_bytes(seed * 31 + i * 1000, n);
    data.insert(data.end(), want[decl[i].name].begin(), want[decl[i].name].end());
  }

  st::Summary summary{};
  {
    st::Writer w(p, decl, meta);
    // Chunks that ignore tensor boundaries: the writer only counts bytes.
    std::span<const std::byte> rest(data);
    for (std::uint64_t k = 0; !rest.empty(); ++k) {
      const std::size_t len = std::min<std::size_t>(rest.size(), zp::test::mix(seed + k) % 40);
      w.write(rest.first(len));
      rest = rest.subspan(len);
    }
    CHECK_FALSE(fs::exists(p));
    summary = w.commit();
  }
  const zp::detail::InputFile in(p);
  CHECK(summary.bytes == in.size());
  CHECK(summary.crc32c == in.crc32c_of_all());

  const st::Reader r(p);
  CHECK(r.metadata() == meta);
  CHECK(r.data_start() % 8 == 0);
  REQUIRE(r.tensors().size() == decl.size());
  std::uint64_t at = 0;
  for (const st::TensorInfo& t : r.tensors()) {
    CAPTURE(t.name);
    CHECK(t.begin == at);
    at = t.end;
    const auto d =
        std::find_if(decl.begin(), decl.end(), [&](const auto& x) { return x.name == t.name; });
    REQUIRE(d != decl.end());
    CHECK(t.dtype == d->dtype);
    CHECK(t.shape == d->shape);
    CHECK(read_all(r, t) == want[t.name]);
    CHECK(&r.at(t.name) == &t);
    CHECK(r.contains(t.name));
    // Typed reads of the zp dtypes, from an element in the middle.
    if (const auto z = st::to_zp(t.dtype); z && t.elements() > 1) {
      zp::visit_dtype(*z, [&](auto x) {
        using T = decltype(x);
        std::vector<T> v(t.elements() - 1);
        r.read_elements(t.name, 1, std::span(v));
        CHECK(std::memcmp(v.data(), want[t.name].data() + sizeof(T), v.size() * sizeof(T)) == 0);
      });
    }
  }
  CHECK(r.tensors()[0].name == "f64");  // file order is the order given to the writer
  CHECK(r.at("scalar").elements() == 1);
  CHECK(r.at("empty").bytes() == 0);
  CHECK_FALSE(r.contains("absent"));

  SUBCASE("reads are range-checked and typed") {
    const std::string f = p.native();
    std::vector<std::byte> buf(8);
    expect_error(zp::Errc::invalid_argument, [&] { (void)r.at("absent"); },
                 {f, "no tensor named 'absent'"});
    expect_error(zp::Errc::invalid_argument, [&] { r.read("i64", 28, buf); },
                 {f, "tensor 'i64' holds 32 bytes; cannot read 8 bytes at byte offset 28"});
    std::vector<float> v(2);
    expect_error(zp::Errc::invalid_argument, [&] { r.read_elements("bf16", 0, std::span(v)); },
                 {f, "tensor 'bf16' stores BF16, not F32"});
    expect_error(zp::Errc::invalid_argument, [&] { r.read_elements("f32", 14, std::span(v)); },
                 {"tensor 'f32' has 15 elements; cannot read 2 from element 14"});
  }
}

TEST_CASE("the Writer checks its declaration, its data and its completion") {
  TempDir dir;
  const fs::path p = dir.path / "w.safetensors";
  const std::string f = p.native();
  using Decl = std::vector<st::TensorInfo>;
  expect_error(zp::Errc::invalid_argument,
               [&] {
                 st::Writer(p, Decl{{"a", "F32", {1}}, {"a", "F32", {1}}});
               },
               {f, "tensor 'a' is declared twice"});
  expect_error(zp::Errc::invalid_argument,
               [&] {
                 st::Writer(p, Decl{{"", "F32", {1}}});
               },
               {f, "tensor #0 has an empty name"});
  expect_error(zp::Errc::invalid_argument,
               [&] {
                 st::Writer(p, Decl{{"__metadata__", "F32", {1}}});
               },
               {"reserved"});
  expect_error(zp::Errc::invalid_argument,
               [&] {
                 st::Writer(p, Decl{{"a", "F33", {1}}});
               },
               {f, "tensor 'a': unknown dtype 'F33'", "BOOL, U8"});
  expect_error(zp::Errc::invalid_argument,
               [&] {
                 st::Writer(p, Decl{{"a", "F32", {1ull << 32, 1ull << 31}}});
               },
               {f, "tensor 'a': shape [4294967296, 2147483648] of F32 does not fit"});
  expect_error(zp::Errc::invalid_argument,
               [&] {
                 st::Writer(p, Decl{{"bad\xff", "F32", {1}}});
               },
               {f, "UTF-8"});
  CHECK(fs::is_empty(dir.path));

  st::Writer w(p, Decl{{"a", "F32", {2}}, {"b", "BF16", {3}}, {"z", "U8", {0}}});
  REQUIRE(w.tensors().size() == 3);
  CHECK(w.tensors()[1].begin == 8);
  CHECK(w.tensors()[1].end == 14);
  const float a[2] = {1.5f, -2.0f};
  const double wrong[1] = {1.0};
  expect_error(zp::Errc::invalid_argument, [&] { w.write(std::span<const double>(wrong)); },
               {f, "tensor 'a' stores F32, not F64"});
  w.write(std::span<const float>(a));
  expect_error(zp::Errc::invalid_argument, [&] { (void)w.commit(); },
               {f, "tensor 'b' is incomplete: 0 of its 6 bytes"});
  const zp::bf16 b[2] = {zp::bf16(1.0f), zp::bf16(2.0f)};
  w.write(std::span<const zp::bf16>(b));
  expect_error(zp::Errc::invalid_argument, [&] { (void)w.commit(); },
               {"tensor 'b' is incomplete: 4 of its 6 bytes"});
  const std::byte extra[3] = {};
  expect_error(
      zp::Errc::invalid_argument, [&] { w.write(extra); },
      {f, "writing 3 bytes at data offset 12 runs past the end of the last tensor 'z' at 14"});
  w.write(std::span(extra, 2));
  CHECK_FALSE(fs::exists(p));
  const st::Summary s = w.commit();
  CHECK(s.bytes == fs::file_size(p));
  expect_error(zp::Errc::invalid_argument, [&] { w.write(std::span(extra, 0)); },
               {"write after commit"});
  const st::Reader r(p);
  float back[2];
  r.read_elements("a", 0, std::span(back));
  CHECK(back[1] == -2.0f);

  SUBCASE("no tensors: a valid, empty file") {
    const fs::path e = dir.path / "empty.safetensors";
    st::Writer(e, {}, {{"k", "v"}}).commit();
    const st::Reader re(e);
    CHECK(re.tensors().empty());
    CHECK(re.metadata().at("k") == "v");
    CHECK(fs::file_size(e) % 8 == 0);
  }
  SUBCASE("destroyed without commit: nothing under the name") {
    const fs::path q = dir.path / "abandoned.safetensors";
    { st::Writer(q, Decl{{"a", "F32", {2}}}).write(std::span<const float>(a)); }
    CHECK_FALSE(fs::exists(q));
    CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);
  }
}

TEST_CASE("a Writer interrupted at any durable step leaves no file and no temporary") {
  TempDir dir;
  const fs::path p = dir.path / "model.safetensors";
  const std::vector<st::TensorInfo> decl = {{"a", "F32", {3}}, {"b", "I64", {2}}};
  const float a[3] = {1, 2, 3};
  const std::int64_t b[2] = {4, 5};
  // Steps: the length and header writes, two data writes, fsync, rename (6), directory fsync.
  bool done = false;
  for (std::int64_t k = 1; !done; ++k) {
    CAPTURE(k);
    REQUIRE(k <= 8);
    zp::detail::io_fault_countdown() = k;
    try {
      st::Writer w(p, decl);
      w.write(std::span<const float>(a));
      w.write(std::span<const std::int64_t>(b));
      w.commit();
      done = true;
    } catch (const zp::Error& e) {
      CHECK(e.message().find("injected fault before") == 0);
    }
    zp::detail::io_fault_countdown() = -1;
    const auto entries = std::distance(fs::directory_iterator(dir.path), fs::directory_iterator());
    if (k <= 6) {
      CHECK(entries == 0);
    } else {  // from the rename on, the file is there, whole
      CHECK(entries == 1);
      std::int64_t back[2];
      st::Reader(p).read_elements("b", 0, std::span(back));
      CHECK(back[1] == 5);
    }
  }
}

TEST_CASE("every malformed header is an error naming the file, the tensor and the values") {
  TempDir dir;
  const fs::path p = dir.path / "model.safetensors";
  const std::string f = p.native() + ": ";
  const auto rejects = [&](const std::string& bytes, const std::string& needle,
                           const std::string& detail = "") {
    put_file(p, bytes);
    expect_error(zp::Errc::io, [&] { st::Reader r(p); }, {f + needle, detail});
  };
  const std::string w = R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  CHECK(st::Reader((put_file(p, raw_file(w, 24)), p)).at("w").elements() == 6);

  rejects(std::string(5, '\0'), "the file has 5 bytes, fewer than the 8 of the header length");
  rejects(raw_file(w, 24, 100'000'001),
          "header length 100000001 is more than the limit of 100000000");
  rejects(raw_file(w, 0, 1000), "header length 1000 runs past the end of the file (" +
                                    std::to_string(8 + w.size()) + " bytes)");
  rejects(raw_file(R"({"w":)", 0), "header:1:6: invalid JSON");
  rejects(raw_file("{\"w\xff\":1}", 0), "header:1:4: invalid JSON", "ill-formed UTF-8");
  rejects(raw_file(R"({"w":"\ud800"})", 0), "header:1:13: invalid JSON");
  // Nesting is bounded while parsing (a million '[' used to overflow the stack), duplicate keys
  // are refused at every level.
  rejects(raw_file(std::string(1'000'000, '[') + std::string(1'000'000, ']'), 0),
          "header: ", "nesting deeper than 32 levels");
  rejects(raw_file(R"({"w":{"dtype":"F32","dtype":"F16","shape":[],"data_offsets":[0,4]}})", 4),
          "header: w.dtype: duplicate key");
  rejects(raw_file("[1, 2]", 0), "header is not a JSON object but [1,2]");
  rejects(raw_file(R"({"w":3})", 0), "tensor 'w': entry is not an object but 3");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[1]}})", 0),
          "tensor 'w': missing field 'data_offsets'");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":0}})", 4),
          "tensor 'w': unexpected field 'x'");
  rejects(raw_file(R"({"w":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", 4),
          "tensor 'w': dtype is not a string but 32");
  rejects(raw_file(R"({"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4),
          "tensor 'w': unknown dtype 'F33'");
  // Names from the file are shortened, and their control characters written as \xNN: a NUL
  // used to end the message there, a newline or escape sequence reached the terminal.
  rejects(
      raw_file(R"({"a\u0000b\n\u001b[2J":{"dtype":"F3\u0000","shape":[1],"data_offsets":[0,4]}})",
               4),
      "tensor 'a\\x00b\\x0a\\x1b[2J': unknown dtype 'F3\\x00'");
  // U+009B (CSI, a C1 control: 0xc2 0x9b in UTF-8) escaped; a long name cut before a character.
  rejects(raw_file(R"({"a\u009bb":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4),
          "tensor 'a\\xc2\\x9bb': unknown dtype 'F33'");
  std::string accents;
  for (int i = 0; i < 40; ++i) accents += "\xc3\xa9";  // U+00E9, 2 bytes each
  rejects(raw_file("{\"" + accents + R"(":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4),
          "tensor '" + accents.substr(0, 56) + "...': unknown dtype 'F33'");
  rejects(raw_file("{\"" + std::string(1000, 'n') +
                       R"(":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})",
                   4),
          "tensor '" + std::string(57, 'n') + "...': unknown dtype 'F33'");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
          "tensor 'w': shape is not an array of non-negative integers but [-1]");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,4]}})", 4),
          "tensor 'w': shape is not an array of non-negative integers but [2.5]");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":7,"data_offsets":[0,4]}})", 4),
          "tensor 'w': shape is not an array of non-negative integers but 7");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
          "tensor 'w': data_offsets has 1 entries, not [begin, end]");
  rejects(
      raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]}})", 4),
      "tensor 'w': data_offsets is not an array of non-negative integers");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", 4),
          "tensor 'w': data_offsets [4, 0) end before they begin");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,12]}})", 12),
          "tensor 'w': data_offsets [0, 12) hold 12 bytes but shape [2, 3] of F32 needs 24");
  rejects(
      raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
      "tensor 'w': shape [4294967296, 4294967296] of F32 holds more than 2^64 bytes");
  rejects(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                   12),
          "tensor 'b': data_offsets [8, 12) leave a gap after tensor 'a' at 4");
  rejects(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
          "tensor 'a': data_offsets [4, 8) leave a gap after the start of the data at 0");
  rejects(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                   12),
          "tensor 'b': data_offsets [4, 12) overlap tensor 'a' at [0, 8)");
  rejects(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                   8),
          "tensor 'e': data_offsets [4, 4) overlap tensor 'a' at [0, 8)");
  rejects(raw_file(w, 30), "the tensors end at data offset 24 but the data section holds 30 bytes");
  rejects(raw_file(w, 20), "the tensors end at data offset 24 but the data section holds 20 bytes");
  rejects(raw_file(R"({"__metadata__":[1]})", 0), "__metadata__ is not an object but [1]");
  rejects(raw_file(R"({"__metadata__":{"k":1}})", 0),
          "__metadata__ entry 'k' is not a string but 1");
  rejects(raw_file(R"({"w":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                   R"("w":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})",
                   4),
          "header: w: duplicate key");
  // Accepted: trailing spaces (the writer's padding), empty tensors between others, no tensors.
  put_file(p, raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("e":{"dtype":"F32","shape":[0],"data_offsets":[1,1]},)"
                       R"("b":{"dtype":"U8","shape":[],"data_offsets":[1,2]}}     )",
                       2));
  CHECK(st::Reader(p).tensors().size() == 3);
  CHECK(st::Reader(p).tensors()[1].name == "e");
  put_file(p, raw_file("{}", 0));
  CHECK(st::Reader(p).tensors().empty());
}

TEST_CASE("the index of a split model round-trips and is validated") {
  TempDir dir;
  const fs::path p = dir.path / "model.safetensors.index.json";
  const std::map<std::string, std::string> map = {{"a", st::shard_file_name(1, 2)},
                                                  {"b", st::shard_file_name(2, 2)}};
  st::write_index(p, 1234, map);
  const st::Index index = st::read_index(p);
  CHECK(index.total_size == 1234);
  CHECK(index.weight_map == map);

  const std::string f = p.native() + ": ";
  const auto rejects = [&](const std::string& text, const std::string& needle) {
    put_file(p, text);
    expect_error(zp::Errc::io, [&] { (void)st::read_index(p); }, {f + needle});
  };
  rejects("{", "index:1:2: invalid JSON");
  rejects(R"({"metadata":)" + std::string(100'000, '['),
          "index: metadata");  // bounded nesting, no stack overflow
  rejects(R"({"metadata":{"total_size":1,"total_size":2},"weight_map":{}})",
          "index: metadata.total_size: duplicate key");
  rejects("[]", "the index is not a JSON object but []");
  rejects(R"({"weight_map":{}})", "the index has no \"metadata\" object");
  rejects(R"({"metadata":{},"weight_map":{}})",
          "metadata.total_size is not a non-negative integer but missing");
  rejects(R"({"metadata":{"total_size":-5},"weight_map":{}})",
          "metadata.total_size is not a non-negative integer but -5");
  rejects(R"({"metadata":{"total_size":5}})", "the index has no \"weight_map\" object");
  rejects(R"({"metadata":{"total_size":5},"weight_map":{"a":3}})",
          "weight_map entry 'a' is not a file name but 3");
  rejects(R"({"metadata":{"total_size":5},"weight_map":{"a":"../x.safetensors"}})",
          "weight_map entry 'a' names '../x.safetensors', not a file next to the index");
  rejects(R"({"metadata":{"total_size":5},"weight_map":{"a":"x\u001b[2J.safetensors"}})",
          "weight_map entry 'a' names 'x\\x1b[2J.safetensors', not a file next to the index");
  expect_error(zp::Errc::io, [&] { (void)st::read_index(dir.path / "absent.json"); },
               {"cannot open"});
}

// Mutations of a valid file, each parsed and read in full: the Reader must accept it or throw
// zp::Error, never crash, hang or allocate beyond the file (ASan and UBSan watch in the asan build).
TEST_CASE("fuzz: the Reader survives corrupted files") {
  const std::uint64_t seed = zp::test::fresh_seed();
  MESSAGE("seed ", seed);
  TempDir dir;
  const fs::path good = dir.path / "good.safetensors";
  {
    std::vector<st::TensorInfo> decl = {{"layer.0.w", "F32", {3, 4}}, {"layer.0.b", "BF16", {5}},
                                        {"scale", "F64", {}},         {"ids", "I64", {2}},
                                        {"none", "F16", {0, 2}},      {"mask", "U8", {3}}};
    st::Writer w(good, decl, {{"format", "pt"}});
    std::uint64_t total = 0;
    for (const auto& t : w.tensors()) total = t.end;
    w.write(random_bytes(seed, total));
    w.commit();
  }
  std::string base(fs::file_size(good), '\0');
  std::ifstream(good, std::ios::binary).read(base.data(), std::streamsize(base.size()));
  const std::uint64_t header_len = st::Reader(good).data_start() - 8;

  const char* snippets[] = {"\"",
                            "{",
                            "}",
                            "[",
                            "]",
                            ",",
                            ":",
                            "-1",
                            "0",
                            "1e400",
                            "2.5",
                            "null",
                            "true",
                            "18446744073709551615",
                            "18446744073709551616",
                            "\"dtype\"",
                            "\"F32\"",
                            "\"BF16\"",
                            "\"shape\":[]",
                            "\"data_offsets\":[0,0]",
                            "\"__metadata__\"",
                            "\\u0000",
                            "\\ud800",
                            "\xff",
                            "\xc3\xa9",
                            "[[[[[[[[",
                            "{\"x\":{}},",
                            "\"layer.0.w\":"};
  std::uint64_t rng = seed;
  const auto next = [&](std::uint64_t bound) { return bound ? zp::test::mix(rng++) % bound : 0; };
  const auto set_len = [](std::string& s, std::uint64_t n) {
    for (int i = 0; i < 8 && std::size_t(i) < s.size(); ++i) s[i] = char(n >> (8 * i));
  };

  const fs::path p = dir.path / "mutant.safetensors";
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string s = base;
    std::uint64_t hlen = header_len;
    for (std::uint64_t m = 0, count = 1 + next(3); m < count; ++m) {
      switch (next(7)) {
        case 0:  // flip bits of a few bytes, mostly in the header
          for (std::uint64_t k = 0, n = 1 + next(4); k < n && !s.empty(); ++k) {
            const std::size_t at =
                next(2) ? std::min<std::size_t>(8 + next(hlen), s.size() - 1) : next(s.size());
            s[at] = char(s[at] ^ char(1 + next(255)));
          }
          break;
        case 1:  // truncate
          s.resize(next(s.size() + 1));
          break;
        case 2: {  // edit the header length: near the truth, or anything
          const std::uint64_t choices[] = {hlen + next(17) - 8, next(base.size() * 2),
                                           ~std::uint64_t(0) - next(3),
                                           st::max_header_bytes + next(2), 0};
          set_len(s, choices[next(5)]);
          break;
        }
        case 3:
        case 4: {  // splice a JSON snippet into the header and, usually, keep the length right
          if (s.size() < 8 || hlen + 8 > s.size()) break;
          const std::string snip = snippets[next(std::size(snippets))];
          const std::size_t at = 8 + next(hlen + 1);
          if (next(2)) {
            s.insert(at, snip);
            hlen += snip.size();
          } else {
            const std::size_t cut = std::min<std::size_t>(snip.size(), 8 + hlen - at);
            s.replace(at, cut, snip);
            hlen += snip.size() - cut;
          }
          if (next(4)) set_len(s, hlen);
          break;
        }
        case 5: {  // change a digit of the header: offsets and shapes that no longer agree
          if (hlen == 0 || s.size() < 8 + hlen) break;
          for (int tries = 0; tries < 20; ++tries) {
            const std::size_t at = 8 + next(hlen);
            if (s[at] >= '0' && s[at] <= '9') {
              s[at] = char('0' + next(10));
              break;
            }
          }
          break;
        }
        case 6:  // grow or shrink the data
          if (next(2))
            s.append(next(16), '\0');
          else
            s.resize(s.size() - std::min<std::size_t>(s.size(), next(16)));
          break;
      }
    }
    put_file(p, s);
    try {
      const st::Reader r(p);
      for (const st::TensorInfo& t : r.tensors()) {
        std::vector<std::byte> v(t.bytes());
        r.read(t.name, 0, v);
        if (const auto z = st::to_zp(t.dtype)) {
          zp::visit_dtype(*z, [&](auto x) {
            std::vector<decltype(x)> e(t.elements());
            r.read_elements(t.name, 0, std::span(e));
          });
        }
      }
      ++accepted;
    } catch (const zp::Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL("iteration ", iter, ": not a zp::Error: ", e.what());
    }
  }
  MESSAGE(accepted, " mutants accepted, ", rejected, " rejected");
  CHECK(accepted > 0);
  CHECK(rejected > 0);
}
