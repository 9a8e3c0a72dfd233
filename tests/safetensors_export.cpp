// The C++ half of zp.test.safetensors.python (tests/safetensors_check.py drives it):
//   safetensors_export write <dir> <seed>
//     writes, with zp::safetensors::Writer, <dir>/single.safetensors (every zp dtype, a scalar, an
//     empty tensor, U8, metadata) and a model split in two files with its index, and describes
//     them in <dir>/single.json and <dir>/split.json: {"metadata": {...}, "tensors": {name:
//     {"dtype", "shape", "bin"}}}, "bin" naming a file of the tensor's expected bytes.
//   safetensors_export engine <dir>
//     trains a small bf16 model on 3 thread ranks with ZeRO stage 3 and exports it with
//     zp::export_safetensors: <dir>/engine/model.safetensors (bf16 parameters, 2-D weights) and
//     <dir>/engine-master/ (fp32 master weights split in several files with an index), described
//     in <dir>/engine.json and <dir>/engine-master.json with the values gather_params() and
//     gather_master() return as the expected bytes.
//   safetensors_export verify <file> <manifest.json>
//     reads <file> (written by Python) with zp::safetensors::Reader and checks it against the
//     manifest bitwise: the same tensors, dtypes, shapes, bytes and metadata.
// Exits non-zero with a message on any difference.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "random.hpp"
#include "zero_mlp.hpp"
#include "zp/backend/threads.hpp"
#include "zp/checkpoint.hpp"
#include "zp/safetensors.hpp"

namespace fs = std::filesystem;
namespace st = zp::safetensors;
using nlohmann::json;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  return {std::istreambuf_iterator<char>(in), {}};
}

void put(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

// Writes one file of `decl` with random bytes, adds each tensor to `manifest` with its .bin.
std::uint64_t write_file(const fs::path& dir, const std::string& file,
                         const std::vector<st::TensorInfo>& decl,
                         const std::map<std::string, std::string>& meta, std::uint64_t seed,
                         json& manifest) {
  st::Writer w(dir / file, decl, meta);
  for (const st::TensorInfo& t : w.tensors()) {
    std::string bytes(t.bytes(), '\0');
    for (std::size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = char(zp::test::mix(seed ^ (t.begin + i) * 0x9e37));
    // Every bit pattern, NaN payloads and subnormals included, must survive; except BOOL, whose
    // only valid bytes are 0 and 1 (numpy's bool would normalise anything else).
    if (t.dtype == "BOOL")
      for (char& c : bytes) c = char(c & 1);
    w.write(std::as_bytes(std::span(bytes)));
    const std::string bin = "expected/" + t.name + ".bin";
    put(dir / bin, bytes);
    manifest["tensors"][t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"bin", bin}, {"file", file}};
  }
  manifest["metadata"] = meta;
  return w.commit().bytes;
}

int write(const fs::path& dir, std::uint64_t seed) {
  fs::create_directories(dir / "expected");
  json single = {{"tensors", json::object()}};
  write_file(dir, "single.safetensors",
             {{"f64", "F64", {2, 3}},
              {"f32", "F32", {3, 5}},
              {"i64", "I64", {4}},
              {"i32", "I32", {11}},
              {"bf16", "BF16", {7}},
              {"f16", "F16", {2, 2, 3}},
              {"u8", "U8", {5}},
              {"scalar", "F32", {}},
              {"empty", "F32", {0, 3}},
              {"flags", "BOOL", {4}}},
             {{"format", "pt"}, {"written_by", "zp"}}, seed, single);
  put(dir / "single.json", single.dump(2));

  // Split: no BF16, so the numpy front end can load each shard whole.
  json split = {{"tensors", json::object()}};
  const int n = 2;
  std::map<std::string, std::string> weight_map;
  std::uint64_t total = 0;
  const std::vector<std::vector<st::TensorInfo>> shards = {
      {{"layers.0.weight", "F32", {4, 3}}, {"layers.0.bias", "F32", {4}}, {"embed", "F16", {5, 2}}},
      {{"layers.1.weight", "F64", {2, 2}}, {"layers.1.bias", "I32", {3}}, {"step", "I64", {}}}};
  for (int i = 0; i < n; ++i) {
    const std::string file = st::shard_file_name(i + 1, n);
    write_file(dir, file, shards[i], {{"format", "pt"}}, seed + 1 + i, split);
    for (const st::TensorInfo& t : shards[i]) {
      weight_map[t.name] = file;
      total += t.elements() * *st::element_size(t.dtype);
    }
  }
  st::write_index(dir / "model.safetensors.index.json", total, weight_map);
  split["metadata"] = {{"format", "pt"}};
  split["total_size"] = total;
  put(dir / "split.json", split.dump(2));
  // The index must read back as written.
  const st::Index index = st::read_index(dir / "model.safetensors.index.json");
  if (index.total_size != total || index.weight_map != weight_map)
    throw std::runtime_error("index round trip differs");
  std::cout << "wrote single.safetensors and a split in " << n << " files to " << dir.string()
            << "\n";
  return 0;
}

int engine(const fs::path& dir) {
  using T = zp::bf16;
  fs::create_directories(dir / "expected");
  std::vector<T> params;
  std::vector<float> master;
  std::vector<std::pair<std::string, std::vector<std::uint64_t>>> shapes;  // forward order
  zp::backend::run_threads(3, [&](zp::Collective<zp::backend::Threads>& comm) {
    zp::test::Mlp<T> model;
    zp::EngineConfig cfg;
    cfg.bucket_bytes = 4096;
    cfg.first_bucket_bytes = 512;
    zp::Engine<zp::backend::Threads, T, 3> e(comm, model, cfg, zp::optim::AdamW{.lr = 1e-2f});
    for (int t = 0; t < 3; ++t) zp::test::micro_step(e, model, (t * 3 + comm.rank()) * 2, 2);
    std::map<std::string, std::vector<std::uint64_t>> shape_of;
    for (std::size_t l = 0; l < model.layers.size(); ++l) {
      const auto& L = model.layers[l];
      shape_of["layer" + std::to_string(l) + ".weight"] = {std::uint64_t(L.in),
                                                           std::uint64_t(L.out)};
      shape_of["layer" + std::to_string(l) + ".bias"] = {std::uint64_t(L.out)};
    }
    zp::ExportOptions o;
    o.shape = [&](const std::string& name, std::size_t) { return shape_of.at(name); };
    zp::export_safetensors(e, dir / "engine", o);
    o.master = true;
    o.max_file_bytes = 12000;
    zp::export_safetensors(e, dir / "engine-master", o);
    auto p = e.gather_params();
    auto m = e.gather_master();
    if (comm.rank() == 0) {
      params = std::move(p);
      master = std::move(m);
      for (const auto& q : e.layout().params()) shapes.emplace_back(q.name, shape_of.at(q.name));
    }
  });
  // The expected bytes come from gather_params/gather_master, not from the export's own path.
  auto describe = [&](const std::string& name, const char* dtype, const std::string& tag,
                      const auto& values) {
    json m = {{"metadata", {{"format", "pt"}}}, {"tensors", json::object()}};
    std::size_t at = 0;
    for (const auto& [param, shape] : shapes) {
      std::uint64_t n = 1;
      for (auto d : shape) n *= d;
      const auto* first = reinterpret_cast<const char*>(values.data() + at);
      const std::string bin = "expected/" + tag + "." + param + ".bin";
      put(dir / bin, std::string(first, n * sizeof(values[0])));
      m["tensors"][param] = {{"dtype", dtype}, {"shape", shape}, {"bin", bin}};
      at += n;
    }
    if (at != values.size())
      throw std::runtime_error("engine export: the shapes do not cover the model");
    put(dir / name, m.dump(2));
  };
  describe("engine.json", "BF16", "engine", params);
  describe("engine-master.json", "F32", "engine-master", master);
  std::cout << "exported a 3-rank stage 3 engine (" << shapes.size() << " tensors) to "
            << dir.string() << "\n";
  return 0;
}

int verify(const fs::path& file, const fs::path& manifest_path) {
  const json manifest = json::parse(slurp(manifest_path));
  const st::Reader r(file);
  int bad = 0;
  const auto fail = [&](const std::string& what) {
    std::cerr << file.string() << ": " << what << "\n";
    ++bad;
  };
  if (r.metadata() != manifest["metadata"].get<std::map<std::string, std::string>>())
    fail("metadata differs");
  if (r.tensors().size() != manifest["tensors"].size())
    fail("holds " + std::to_string(r.tensors().size()) + " tensors, expected " +
         std::to_string(manifest["tensors"].size()));
  for (const auto& [name, want] : manifest["tensors"].items()) {
    if (!r.contains(name)) {
      fail("tensor '" + name + "' is missing");
      continue;
    }
    const st::TensorInfo& t = r.at(name);
    if (t.dtype != want["dtype"].get<std::string>())
      fail("tensor '" + name + "' has dtype " + t.dtype);
    if (t.shape != want["shape"].get<std::vector<std::uint64_t>>())
      fail("tensor '" + name + "' has shape " + json(t.shape).dump() + ", expected " +
           want["shape"].dump());
    const std::string expected =
        slurp(manifest_path.parent_path() / want["bin"].get<std::string>());
    std::string got(t.bytes(), '\0');
    r.read(name, 0, std::as_writable_bytes(std::span(got)));
    if (got != expected)
      fail("tensor '" + name + "' differs from " + want["bin"].get<std::string>());
  }
  if (bad) return 1;
  std::cout << "zp read " << r.tensors().size() << " tensors of " << file.string()
            << " bitwise as expected\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "write" && argc == 4) return write(argv[2], std::strtoull(argv[3], nullptr, 10));
  if (mode == "verify" && argc == 4) return verify(argv[2], argv[3]);
  if (mode == "engine" && argc == 3) return engine(argv[2]);
  std::cerr << "usage: " << argv[0]
            << " write <dir> <seed> | engine <dir> | verify <file> <manifest.json>\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "safetensors_export: " << e.what() << "\n";
  return 1;
}
